"""`copy(..., first=(dim, n))`: only a KV home's written positions move; on CUDA one pitched copy per tensor
(`engine.storage.pitched`), bit-exact against slicing, untouched positions left as they were."""
import pytest
import torch

from engine.quant.config import QuantConfig
from engine.quant.group import quantize
from engine.storage.copy import copy
from engine.storage.pitched import _pitched_plan, _rows_of_runs, pitched_available, prefix_copy
from helpers.skips import requires_cuda


def test_rows_of_runs_reads_a_home_and_its_row_slices():
    home = torch.zeros(6, 4, 10, 8)                                   # [b, h, S, hd]
    assert _rows_of_runs(home, 2) == (24, 80)
    assert _rows_of_runs(home[:3], 2) == (12, 80)                     # a compacted home: leading rows
    assert _rows_of_runs(home[:, 1:3], 2) is None                     # heads cut: rows not evenly pitched
    assert _rows_of_runs(home.transpose(2, 3), 2) is None             # not contiguous past dim
    assert _rows_of_runs(torch.zeros(1, 1, 10, 8), 2) == (1, 80)
    assert _rows_of_runs(home[:, :, :5], 2) == (24, 80)               # a slice keeps the home's pitch


def test_a_positions_major_home_is_one_run_per_row():
    """A home held as memory [b, S, h, hd] (seen as [b, h, S, hd]) copies its written positions as one run
    per row, h times a head's; a head-major home as one per (row, head); mixed layouts go to torch."""
    home = torch.zeros(6, 10, 4, 8).transpose(1, 2)                  # [b, h, S, hd], memory [b, S, h, hd]
    assert _pitched_plan(home, home, 5, 2) == (6, 1280, 1280, 640)   # 5 positions x 4 heads x 8 x 4 B
    assert _pitched_plan(home[:3], home[:3], 5, 2) == (3, 1280, 1280, 640)       # a compacted home
    one_head = torch.zeros(6, 10, 1, 8).transpose(1, 2)
    assert _pitched_plan(one_head, one_head, 5, 2) == (6, 320, 320, 160)
    heads = torch.zeros(6, 4, 10, 8)
    assert _pitched_plan(heads, heads, 5, 2) == (24, 320, 320, 160)
    assert _pitched_plan(heads, home, 5, 2) is None
    assert _pitched_plan(home[:, 1:3], home[:, 1:3], 5, 2) is None  # heads cut: not one run per row


@pytest.mark.parametrize("quant", [None, QuantConfig(bits=4, group_size=4)])
def test_copy_first_moves_only_the_written_positions(quant):
    torch.manual_seed(0)
    src = torch.randn(3, 2, 9, 8)
    dst = torch.randn(3, 2, 9, 8)
    if quant is not None:
        src, dst = quantize(src, quant), quantize(dst, quant)
    before = [p.clone() for p in (dst.parts() if quant else (dst,))]
    assert copy(dst, src, first=(2, 5)) is None
    for d, s, b in zip(dst.parts() if quant else (dst,), src.parts() if quant else (src,), before):
        assert torch.equal(d[:, :, :5], s[:, :, :5])
        assert torch.equal(d[:, :, 5:], b[:, :, 5:])


def test_prefix_copy_rejects_mismatched_tensors():
    with pytest.raises(ValueError, match="prefix_copy"):
        prefix_copy(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), 2, 2, None)
    with pytest.raises(ValueError, match="positions"):
        prefix_copy(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), 5, 2, None)


@requires_cuda
@pytest.mark.parametrize("rows", [7, 4])
@pytest.mark.parametrize("positions_major", [False, True])
def test_pitched_copy_both_ways_on_cuda(rows, positions_major):
    """Host -> device and back, a compacted home's leading rows included, head-major or positions-major
    (memory [b, S, h, ...]): exact, the rest untouched."""
    assert pitched_available()
    torch.manual_seed(1)
    quant = QuantConfig(bits=4, group_size=64)
    host = quantize(torch.randn(7, 4, 33, 128), quant)
    host = type(host)(*(p.pin_memory() for p in host.parts()), host.shape, host.config, host.dtype)[:rows]
    dev = quantize(torch.randn(rows, 4, 33, 128, device="cuda"), quant)
    if positions_major:
        host = type(host)(*(p.transpose(1, 2).contiguous().pin_memory().transpose(1, 2) for p in host.parts()),
                          host.shape, host.config, host.dtype)
        dev = dev.transpose(1, 2).contiguous().transpose(1, 2)
        assert _pitched_plan(dev.data, host.data, 20, 2)[0] == rows
    before = [p.clone() for p in dev.parts()]
    stream = torch.cuda.Stream()
    copy(dev, host, stream=stream, first=(2, 20)).synchronize()
    for d, h, b in zip(dev.parts(), host.parts(), before):
        assert torch.equal(d[:, :, :20].cpu(), h[:, :, :20])
        assert torch.equal(d[:, :, 20:], b[:, :, 20:])
    back = torch.zeros(rows, 4, 33, 128, dtype=torch.bfloat16).pin_memory()
    src = torch.randn(rows, 4, 33, 128, device="cuda", dtype=torch.bfloat16)
    copy(back, src, stream=stream, first=(2, 11)).synchronize()
    assert torch.equal(back[:, :, :11], src[:, :, :11].cpu()) and not back[:, :, 11:].any()
