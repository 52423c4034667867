"""Changed weights never get another model's stored answers: the weights' fingerprint covers every byte of every
tensor, so a copy with two equal-size tensors swapped (its size, metadata, first and last MiB and even its mtime
unchanged) gets no result-cache hit, while an unchanged model gets all of them; the digest is paid once per file
version."""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import engine.util.file_digest as file_digest_mod
from engine.models.gguf_convert import gguf_fingerprint
from engine.models.loader import load_model
from helpers.fake_engine import FakeLLM
from helpers.gguf_tiny import write_gguf
from llmops.core import MapSpec, map_table

ROWS = pa.table({"b": [f"row {i}" for i in range(6)]})


def _swap(path: Path, a: tuple[int, int], b: tuple[int, int]) -> None:
    """Swap two equal-length byte ranges (offset, length) of `path` in place, keeping its mtime."""
    st = path.stat()
    assert a[1] == b[1]
    with open(path, "r+b") as f:
        f.seek(a[0])
        first = f.read(a[1])
        f.seek(b[0])
        second = f.read(b[1])
        assert first != second
        f.seek(a[0])
        f.write(second)
        f.seek(b[0])
        f.write(first)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _gguf_ranges(path: Path, names: tuple[str, str]) -> list[tuple[int, int]]:
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    return [(int(tensors[n].data_offset), int(tensors[n].n_bytes)) for n in names]


def _safetensors_ranges(path: Path, names: tuple[str, str]) -> list[tuple[int, int]]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return [(8 + size + header[n]["data_offsets"][0], header[n]["data_offsets"][1] - header[n]["data_offsets"][0])
            for n in names]


def _hits(fingerprint: str, cache: Path) -> tuple[int, int]:
    """(cache hits, rows generated) of one run over ROWS by an engine with this weights fingerprint."""
    eng = FakeLLM(fingerprint=fingerprint)
    run = map_table(ROWS, MapSpec("Say {b}"), engine=eng, cache_dir=cache)
    run.ordered()
    return run.summary.cache_hits, eng.prompts_seen


def _assert_no_stale_hits(original: str, swapped: str, cache: Path) -> None:
    assert original != swapped
    assert _hits(original, cache) == (0, 6)
    assert _hits(swapped, cache) == (0, 6)        # the swapped copy never gets the original's answers
    assert _hits(original, cache) == (6, 0)       # an unchanged model gets every one of its own


def test_a_gguf_with_swapped_tensors_between_its_first_and_last_mib(tmp_path):
    """The tensors sit past the first MiB (metadata) and before the last: a size + first/last MiB digest
    would call both files equal."""
    import gguf

    rng = np.random.default_rng(0)
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.notes", "metadata " * (140 << 10))       # > 1 MiB of metadata first
    for name in ("blk.0.ffn_up.weight", "blk.1.ffn_up.weight"):
        w.add_tensor(name, rng.random((256, 1024), dtype=np.float32))
    w.add_tensor("output.weight", rng.random((300, 1024), dtype=np.float32))   # > 1 MiB of tail
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    copy = tmp_path / "copy.gguf"
    shutil.copy2(path, copy)
    a, b = _gguf_ranges(copy, ("blk.0.ffn_up.weight", "blk.1.ffn_up.weight"))
    assert 1 << 20 < a[0] and b[0] + b[1] < copy.stat().st_size - (1 << 20)
    _swap(copy, a, b)
    assert copy.stat().st_size == path.stat().st_size
    models = tmp_path / "models"
    _assert_no_stale_hits(gguf_fingerprint(path, models), gguf_fingerprint(copy, models), tmp_path / "cache")


def test_a_loaded_gguf_with_two_layers_swapped(tiny_checkpoints, tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("LLMOPS_MODEL_CACHE", str(tmp_path / "models"))
    path = tmp_path / "tiny.gguf"
    folder = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    write_gguf(folder, path, "llama", gguf.GGMLQuantizationType.F32)
    copy = tmp_path / "tiny-copy.gguf"
    shutil.copy2(path, copy)
    _swap(copy, *_gguf_ranges(copy, ("blk.0.attn_q.weight", "blk.1.attn_q.weight")))
    original, swapped = load_model(path).fingerprint, load_model(copy).fingerprint
    _assert_no_stale_hits(original, swapped, tmp_path / "cache")
    assert load_model(path).fingerprint == original


def test_a_safetensors_folder_with_two_layers_swapped_in_place(tiny_checkpoints, tmp_path, monkeypatch):
    """Copied with its mtimes (cp -p, rsync -t), then rewritten in place with its mtime put back."""
    monkeypatch.setenv("LLMOPS_MODEL_CACHE", str(tmp_path / "models"))
    original = tmp_path / "original"
    shutil.copytree(tiny_checkpoints["llama"], original)
    before = load_model(original).fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert load_model(copy).fingerprint == before                  # an identical copy is the same model
    weights = copy / "model.safetensors"
    _swap(weights, *_safetensors_ranges(weights, ("model.layers.0.self_attn.q_proj.weight",
                                                  "model.layers.1.self_attn.q_proj.weight")))
    _assert_no_stale_hits(before, load_model(copy).fingerprint, tmp_path / "cache")


def test_the_digest_is_paid_once_per_file_version(tmp_path, monkeypatch):
    calls = []
    real = file_digest_mod.content_digest
    monkeypatch.setattr(file_digest_mod, "content_digest", lambda p: calls.append(p) or real(p))
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * 4096)
    first = file_digest_mod.file_digest(path, tmp_path / "models")
    assert file_digest_mod.file_digest(path, tmp_path / "models") == first and len(calls) == 1
    _swap(path, (1, 1024), (4096, 1024))                           # same size, same mtime: the ctime moves
    assert file_digest_mod.file_digest(path, tmp_path / "models") != first and len(calls) == 2
    (tmp_path / "models" / "weight_digests.json").write_text("{not json")      # an unreadable record is rebuilt
    assert file_digest_mod.file_digest(path, tmp_path / "models") != first and len(calls) == 3
    assert file_digest_mod.content_digest(path) == file_digest_mod.file_digest(path, None)


@pytest.mark.parametrize("size", [0, 1, 3 * (1 << 16) + 7])
def test_every_byte_counts_whatever_the_size(size, tmp_path, monkeypatch):
    monkeypatch.setattr(file_digest_mod, "CHUNK", 1 << 16)      # several chunks, hashed on several threads
    path = tmp_path / "w.bin"
    data = os.urandom(size)
    path.write_bytes(data)
    digest = file_digest_mod.content_digest(path)
    assert file_digest_mod.content_digest(path) == digest
    for at in sorted({0, size // 2, size - 1}) if size else []:
        changed = bytearray(data)
        changed[at] ^= 1
        path.write_bytes(bytes(changed))
        assert file_digest_mod.content_digest(path) != digest
