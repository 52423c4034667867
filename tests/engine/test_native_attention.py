"""The CPU decode-attention C kernel (engine.models.native_attention) against float32 SDPA, its routing from
`decode_attention`, and the build helper (engine.util.native): caching, refusal and fallback."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models import native_attention as na
from engine.models.attention import decode_attention
from engine.util import native
from helpers.native_kernels import failing_build

AVAILABLE = na._kernel() is not None
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason="no AVX512-BF16 CPU or C compiler: the kernel is not built")


def _case(b: int, nkv: int, g: int, hd: int, t: int, seed: int = 0, spare: int = 7):
    """q [b, nkv*g, 1, hd] strided as a projection leaves it, k/v views [b, nkv, t, hd] of a longer cache."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 1, nkv * g + 2 * nkv, hd, generator=gen).to(torch.bfloat16)[:, :, :nkv * g].transpose(1, 2)
    k, v = (torch.randn(b, nkv, t + spare, hd, generator=gen).to(torch.bfloat16)[:, :, :t] for _ in range(2))
    return q, k, v


def _reference(q, k, v, valid, scale):
    """float32 SDPA over the same bfloat16 values -> [b, nh, 1, hd] float32."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=valid[:, None, None, :],
                                          scale=scale, enable_gqa=True)


@needs_kernel
@pytest.mark.parametrize("b,nkv,g,hd,t", [(1, 3, 3, 64, 1), (5, 3, 3, 64, 145), (2, 2, 7, 64, 200),
                                          (3, 1, 16, 128, 33), (4, 4, 1, 32, 64), (2, 8, 8, 128, 300)])
def test_matches_float32_sdpa_within_bfloat16_rounding(b, nkv, g, hd, t):
    q, k, v = _case(b, nkv, g, hd, t)
    gen = torch.Generator().manual_seed(1)
    valid = torch.rand(b, t, generator=gen) > 0.25
    valid[:, -1] = True
    got = na.native_decode_attention(q, k, v, valid, hd ** -0.5)
    want = _reference(q, k, v, valid, hd ** -0.5)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=hd ** -0.5,
                                          enable_gqa=True).float()
    assert got is not None and got.shape == (b, nkv * g, 1, hd) and got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= (sdpa - want).abs().max() + 2 ** -8


@needs_kernel
@pytest.mark.parametrize("g", [2, 3, 4, 5, 8, 16])
def test_a_head_attends_alike_in_any_group(g):
    """Each group size (those compiled for it and the copy for any g) gives every query head the output it
    gets alone, its kv head repeated per query head (groups of 1), bit for bit."""
    q, k, v = _case(3, 2, g, 64, 90)
    gen = torch.Generator().manual_seed(2)
    valid = torch.rand(3, 90, generator=gen) > 0.25
    valid[:, -1] = True
    grouped = na.native_decode_attention(q, k, v, valid, 0.125)
    alone = na.native_decode_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), valid, 0.125)
    assert grouped is not None and torch.equal(grouped, alone)


@needs_kernel
def test_masked_leading_blocks_and_a_tail_are_skipped_exactly():
    """A row whose first 150 keys (two whole 64-key blocks and more) are masked attends only to the rest: the
    same output as attending to that slice alone; the other row's mask is all True."""
    q, k, v = _case(2, 3, 3, 64, 181)
    valid = torch.ones(2, 181, dtype=torch.bool)
    valid[0, :150] = False
    got = na.native_decode_attention(q, k, v, valid, 0.125)
    alone = na.native_decode_attention(q[:1], k[:1, :, 150:], v[:1, :, 150:], valid[:1, 150:], 0.125)
    assert torch.equal(got[:1], alone)
    assert not torch.isnan(got).any()


@needs_kernel
def test_masked_values_are_never_read():
    """Masked keys inside partly valid runs of 16 (a row's padding after a shared prefix, single gaps): NaN in
    their keys and values gives the output that zeros there give, bit for bit."""
    q, k, v = _case(3, 3, 3, 64, 150)
    valid = torch.ones(3, 150, dtype=torch.bool)
    valid[0, 24:61] = False
    valid[1, 5:7] = False
    valid[2, 1::3] = False
    hidden = ~valid[:, None, :, None]                                           # [b, 1, t, 1]
    zeros = [x.masked_fill(hidden, 0.0) for x in (k, v)]
    nans = [x.masked_fill(hidden, float("nan")) for x in (k, v)]
    want = na.native_decode_attention(q, *zeros, valid, 0.125)
    got = na.native_decode_attention(q, *nans, valid, 0.125)
    assert not torch.isnan(want).any()
    assert torch.equal(got, want)


@needs_kernel
def test_cpu_decode_attention_takes_the_kernel_for_bfloat16():
    q, k, v = _case(3, 3, 3, 64, 50)
    valid = torch.ones(3, 50, dtype=torch.bool)
    valid[0, :9] = False
    assert torch.equal(decode_attention(q, k, v, valid, 0.125), na.native_decode_attention(q, k, v, valid, 0.125))


def test_shapes_and_dtypes_it_does_not_take_return_none():
    q, k, v = _case(2, 2, 2, 64, 20)
    valid = torch.ones(2, 20, dtype=torch.bool)
    assert na.native_decode_attention(q.float(), k.float(), v.float(), valid, 0.1) is None          # float32
    assert na.native_decode_attention(*(x[..., :48] for x in (q, k, v)), valid, 0.1) is None         # hd 48
    assert na.native_decode_attention(q, k, v, valid.to(torch.uint8), 0.1) is None                   # mask dtype
    assert na.native_decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, valid, 0.1) is None
    q17, k1, v1 = _case(1, 1, 17, 64, 10)
    assert na.native_decode_attention(q17, k1, v1, torch.ones(1, 10, dtype=torch.bool), 0.1) is None  # g > 16


def test_softcapped_decode_never_takes_the_kernel():
    """Gemma2's soft-capping is not in the kernel: `decode_attention` with a cap equals the explicit core."""
    q, k, v = _case(2, 2, 2, 64, 30)
    valid = torch.ones(2, 30, dtype=torch.bool)
    out = decode_attention(q, k, v, valid, 0.125, softcap=5.0)
    qg = q.reshape(2, 2, 2, 64)
    from engine.models.attention import softcapped_attention
    want = softcapped_attention(qg, k, v, valid[:, None, None, :], 0.125, 5.0).reshape(2, 4, 1, 64)
    assert torch.equal(out, want)


def test_a_missing_cpu_flag_or_compiler_is_unavailable_not_an_error(tmp_path, monkeypatch):
    with pytest.raises(native.NativeUnavailable, match="lacks"):
        native.build_library(na.SOURCE, native.AVX512_BF16_FLAGS, frozenset({"no_such_flag"}), tmp_path)
    monkeypatch.setattr(native, "compiler", lambda: None)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(native.AVX512_BF16_CPU))
    monkeypatch.setattr(native.platform, "system", lambda: "Linux")
    with pytest.raises(native.NativeUnavailable, match="no C compiler"):
        native.build_library(na.SOURCE, native.AVX512_BF16_FLAGS, native.AVX512_BF16_CPU, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
def test_a_library_is_built_once_and_rebuilt_for_an_edited_source_or_header(tmp_path):
    src, header = tmp_path / "add.c", tmp_path / "extra.h"
    header.write_text("#define EXTRA 0\n")
    src.write_text('#include "extra.h"\nint add(int a, int b) { return a + b + EXTRA; }\n')
    flags = ("-O2", "-shared", "-fPIC")
    lib = native.build_library(src, flags, frozenset(), tmp_path / "out")
    assert lib.add(2, 3) == 5
    built = native.library_path(src, flags, native.compiler(), tmp_path / "out")
    stamp = built.stat().st_mtime_ns
    native.build_library(src, flags, frozenset(), tmp_path / "out")
    assert built.stat().st_mtime_ns == stamp                                   # loaded, not compiled again
    header.write_text("#define EXTRA 1\n")
    assert native.library_path(src, flags, native.compiler(), tmp_path / "out") != built
    assert native.build_library(src, flags, frozenset(), tmp_path / "out").add(2, 3) == 6


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
def test_a_compiler_error_names_the_source_and_leaves_no_library(tmp_path):
    src = tmp_path / "broken.c"
    src.write_text("int broken( { return 0; }\n")
    with pytest.raises(RuntimeError, match="could not build broken.c"):
        native.build_library(src, ("-shared", "-fPIC"), frozenset(), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))


def test_a_kernel_that_fails_to_build_warns_once_and_sdpa_runs(monkeypatch):
    with failing_build(monkeypatch, na._kernel):
        with pytest.warns(RuntimeWarning, match="native decode attention: the C kernel failed.*using torch ops"):
            assert na._kernel() is None
        q, k, v = _case(2, 3, 3, 64, 40)
        valid = torch.ones(2, 40, dtype=torch.bool)
        with warnings.catch_warnings():
            warnings.simplefilter("error")                                     # warned once, not per call
            out = decode_attention(q, k, v, valid, 0.125)
        want = F.scaled_dot_product_attention(q.reshape(2, 3, 3, 64), k, v, attn_mask=valid[:, None, None, :],
                                              scale=0.125).reshape(2, 9, 1, 64)
        assert torch.equal(out, want)


def test_the_source_ships_beside_its_module():
    assert na.SOURCE.is_file() and na.SOURCE.parent == Path(na.__file__).parent
    assert "llmops_decode_attention_bf16" in na.SOURCE.read_text()
