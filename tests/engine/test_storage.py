"""Storage: placement rules, budgets, the copy function, and the verified disk layout."""
from __future__ import annotations

import json

import pytest
import torch

from engine.policy.placement import split_ranges, weight_tiers
from engine.quant import dequantize, quantize
from engine.storage import BudgetExceeded, MemoryBudget, Tier, copy
from engine.storage.disk import ScratchFiles, WeightFiles
from engine.runtime.arena import Arena
from engine.storage.pinned import HostPool


def test_weight_tiers_by_cumulative_midpoints():
    assert weight_tiers([10, 10, 10, 10], 0.5, 0.5) == [Tier.GPU, Tier.GPU, Tier.CPU, Tier.CPU]
    assert weight_tiers([10, 10, 10, 10], 0.25, 0.25) == [Tier.GPU, Tier.CPU, Tier.DISK, Tier.DISK]
    assert weight_tiers([100, 1], 0.4, 0.0) == [Tier.DISK, Tier.DISK]
    assert weight_tiers([1, 100], 1.0, 0.0) == [Tier.GPU, Tier.GPU]


def test_split_ranges_cover_once():
    for n in (1, 2, 3, 8, 9):
        for gpu, cpu in ((1, 0), (0, 1), (0, 0), (0.5, 0.5), (0.3, 0.3), (0.5, 0.0)):
            ranges = split_ranges(n, gpu, cpu)
            covered = [i for _, a, b in ranges for i in range(a, b)]
            assert covered == list(range(n))
    assert split_ranges(4, 0.5, 0.25) == [(Tier.GPU, 0, 2), (Tier.CPU, 2, 3), (Tier.DISK, 3, 4)]


def test_budget_fails_fast_naming_the_item():
    budget = MemoryBudget({Tier.GPU: 1000, Tier.CPU: None})
    budget.reserve(Tier.GPU, 600, "home.layers.0.mlp.weight")
    budget.reserve(Tier.CPU, 10**12, "anything")
    with pytest.raises(BudgetExceeded, match=r"gpu memory budget exceeded: kv.1.0.*needs 500 B.*600 B of the 1000 B"):
        budget.reserve(Tier.GPU, 500, "kv.1.0 [2, 2]")
    budget.release(Tier.GPU, 600, "home.layers.0.mlp.weight")
    budget.reserve(Tier.GPU, 500, "kv.1.0")
    assert budget.peak[Tier.GPU] == 600


def test_copy_dense_and_quantized_between_host_and_disk(tmp_path):
    scratch = ScratchFiles(tmp_path)
    x = torch.randn(4, 64)
    on_disk = scratch.empty((4, 64), torch.float32)
    assert copy(on_disk, x) is None                                              # host copies complete on return
    back = torch.empty(4, 64)
    copy(back, on_disk)
    assert torch.equal(back, x)
    q = quantize(x)
    q2 = quantize(torch.zeros(4, 64))
    copy(q2, q)
    assert torch.equal(dequantize(q2), dequantize(q))
    with pytest.raises(TypeError):
        copy(back, q)
    scratch.close()
    assert not scratch.dir.exists()


def _tensors():
    torch.manual_seed(0)
    return {"w": torch.randn(300, 64, dtype=torch.bfloat16), "q": quantize(torch.randn(16, 128))}


def test_weight_file_written_once_and_reused(tmp_path):
    files = WeightFiles(tmp_path)
    built = []
    first = files.load("layer0", lambda: built.append(1) or _tensors())
    again = WeightFiles(tmp_path).load("layer0", lambda: built.append(1) or _tensors())
    assert built == [1]
    assert torch.equal(again["w"], _tensors()["w"]) and torch.equal(first["w"], again["w"])
    assert torch.equal(dequantize(again["q"]), dequantize(_tensors()["q"]))
    assert not list(tmp_path.glob(".*tmp*"))                                      # temp names renamed away


@pytest.mark.parametrize("damage", ["truncate", "flip", "marker"])
def test_damaged_weight_file_is_rebuilt(tmp_path, damage):
    files = WeightFiles(tmp_path)
    files.load("layer0", _tensors)
    data, marker = files.paths("layer0")
    if damage == "truncate":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[10] ^= 0xFF
        data.write_bytes(bytes(raw))
    else:
        marker.write_text(json.dumps({"format": 2}))
    built = []
    fresh = WeightFiles(tmp_path)
    got = fresh.load("layer0", lambda: built.append(1) or _tensors())
    assert built == [1] and fresh.rebuilt == ["layer0"]
    assert torch.equal(got["w"], _tensors()["w"])


def test_weight_file_records_rotation(tmp_path):
    from engine.quant import QuantConfig

    torch.manual_seed(0)
    x = torch.randn(8, 64)
    cfg = QuantConfig(group_size=32, rotate=True)
    WeightFiles(tmp_path).load("layer0", lambda: {"q": quantize(x, cfg)})
    _, marker = WeightFiles(tmp_path).paths("layer0")
    entry = [e for e in json.loads(marker.read_text())["entries"] if "qshape" in e][0]
    assert entry["rotate"] is True and entry["group_size"] == 32
    again = WeightFiles(tmp_path).load("layer0", lambda: pytest.fail("rebuilt a valid file"))
    assert again["q"].config == cfg
    assert torch.equal(dequantize(again["q"]), dequantize(quantize(x, cfg)))


def test_host_pool_reuses_freed_space_and_merges_neighbours():
    pool = HostPool(pin=False, chunk_bytes=8192, pooled=True)
    a = pool.empty((1024,), torch.uint8)                 # 1024 B
    b = pool.empty((256,), torch.float32)                # 1024 B, after a
    c = pool.empty((1000,), torch.uint8)                 # rounded to 1024 B
    assert pool.reserved_bytes == 8192 and pool.free_bytes == 8192 - 3 * 1024
    b.fill_(7)
    pool.free(a)
    pool.free(b)                                         # a and b merge into one 2048 B range
    grown = pool.empty((2048,), torch.uint8)
    assert grown.data_ptr() == a.data_ptr()              # the grown buffer takes the space it left
    assert pool.reserved_bytes == 8192
    pool.free(c)
    pool.free(grown)
    assert pool.free_bytes == 8192
    big = pool.empty((3, 4096), torch.uint8)             # larger than a chunk: a new power-of-two chunk
    assert big.shape == (3, 4096) and pool.reserved_bytes == 8192 + 16384


def test_arena_gives_a_grown_cpu_buffer_back_to_its_pool():
    arena = Arena(torch.device("cpu"), MemoryBudget({Tier.GPU: None, Tier.CPU: None, Tier.DISK: None}), None)
    arena.host = HostPool(pin=False, chunk_bytes=1 << 16, pooled=True)
    first = arena.get("kv", Tier.CPU, (8, 100), torch.float16)
    arena.get("stage", Tier.CPU, (10,), torch.float16)
    arena.get("kv", Tier.CPU, (8, 200), torch.float16)     # grows past its old range, which goes back
    again = arena.get("other", Tier.CPU, (8, 100), torch.float16)
    assert again.data_ptr() == first.data_ptr()
    assert arena.host.reserved_bytes == 1 << 16
