"""The fused 4-bit decode attention (`engine.models.quant_decode`): the chunked path's answer within float
rounding, in Triton's CPU interpreter (where Triton is installed), compiled for sm_90 without a GPU, and on
CUDA; elsewhere the dispatcher declines (None) and the chunked path runs."""
from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_model
from engine.models.quant_decode import _reference, _triton_ready, quantized_decode_attention
from engine.policy.policy import Policy
from engine.quant.config import QuantConfig
from engine.quant.group import quantize
from engine.runtime import kv_cache
from helpers.greedy_runs import make_prompts, run_policy
from helpers.skips import requires_cuda
from helpers.triton_kernels import assert_self_check_passes, compile_for_sm90, run_interpreted

_INTERPRETED = """
import torch
from engine.models import quant_decode
from engine.models.quant_decode import _parts, _reference, fused, self_check
from engine.quant.config import QuantConfig
from engine.quant.group import quantize

assert self_check(torch.device("cpu"))
gen = torch.Generator().manual_seed(1)
cases = ((torch.float16, False, None, 0, 1, 128, 64), (torch.float16, False, None, 7, 4, 128, 64),
         (torch.float32, False, 50.0, 3, 2, 96, 64), (torch.bfloat16, True, None, 0, 1, 64, 64),
         (torch.float16, True, None, 40, 8, 128, 64), (torch.float32, False, None, 5, 3, 128, 64))
# MHA, GQA + prefix, padded groups + softcap, rotated, Llama-3-70B's groups of 8 (rotated, a long prefix),
# a group size that is no power of two (the program's padded heads are masked)
for dtype, rot, cap, L, g, hd, gs in cases:
    cfg = QuantConfig(group_size=gs, rotate=rot)
    b, nkv, S, t = 4, 3, 100, 70
    width = (hd + gs - 1) // gs * gs if rot else hd
    q = torch.randn(b, nkv * g, 1, hd, generator=gen).to(dtype)
    k = quantize(torch.randn(b, nkv, S, hd, generator=gen).to(dtype) * 3, cfg)
    v = quantize(torch.randn(b, nkv, S, hd, generator=gen).to(dtype), cfg)
    prefix = tuple(torch.randn(1, nkv, L, width, generator=gen).to(dtype) for _ in range(2)) if L else None
    valid = torch.rand(b, L + t, generator=gen) > 0.3
    valid[:, -1] = True
    valid[2] = False                                   # a row without a valid key gives zeros, not NaN
    got = fused(q, _parts(k, t), _parts(v, t), t, valid, hd ** -0.5, cap, cfg if rot else None, prefix)
    assert torch.equal(got[2], torch.zeros_like(got[2])), dtype
    keep = [0, 1, 3]
    want = _reference(q[keep], k[keep], v[keep], t, valid[keep], hd ** -0.5, cap, prefix)
    ulp = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    err = (got[keep].float() - want.float()).abs().max().item()
    assert err <= ulp * want.float().abs().max().item(), (dtype, rot, cap, L, g, hd, err)
    if L:                                              # a prefix's rows one at a time give the same answer
        quant_decode.PREFIX_STATE_BYTES, whole = 1, quant_decode.PREFIX_STATE_BYTES
        one_by_one = fused(q, _parts(k, t), _parts(v, t), t, valid, hd ** -0.5, cap, cfg if rot else None, prefix)
        quant_decode.PREFIX_STATE_BYTES = whole
        assert torch.allclose(one_by_one.float(), got.float(), rtol=ulp, atol=ulp), (dtype, L, g)
"""


def test_kernel_in_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED)


@pytest.mark.parametrize("dt", ["*fp16", "*bf16", "*fp32"])
def test_kernel_compiles_for_sm90(dt):
    pytest.importorskip("triton")
    import triton.language as tl    # optional dependency: Triton

    from engine.models._quant_decode_triton import _quant_decode_kernel, block_t

    out = {"*fp16": tl.float16, "*bf16": tl.bfloat16, "*fp32": tl.float32}[dt]
    mid = tl.float32 if dt == "*fp32" else tl.float16
    sc = "*fp32" if dt == "*fp32" else "*fp16"
    ints = ("T", "D", "nkv", "g", "q_b", "q_h", "kd_b", "kd_h", "kd_t", "km_b", "km_h", "km_t", "vd_b", "vd_h",
            "vd_t", "vm_b", "vm_h", "vm_t", "valid_b", "out_b", "out_h")
    sig = {"q_ptr": dt, "kd_ptr": "*u8", "kmn_ptr": sc, "ksc_ptr": sc, "vd_ptr": "*u8", "vmn_ptr": sc,
           "vsc_ptr": sc, "m0_ptr": "*fp32", "l0_ptr": "*fp32", "a0_ptr": "*fp32", "valid_ptr": "*u8",
           "out_ptr": dt, **{k: "i64" for k in ints}, "scale": "fp32", "softcap": "fp32",
           **{k: "constexpr" for k in ("HALF", "W2", "BLOCK_W", "BLOCK_T", "GB", "MID", "OUT", "SOFTCAP", "STATE")}}
    # head_dim 128, 64, 256 with one query head a kv head (MHA); groups of 8 (Llama-3-70B), 4 and 2; with and
    # without a prefix's state
    for softcap, w2, gb, state in ((False, 64, 1, False), (True, 64, 1, True), (False, 32, 1, False),
                                   (False, 128, 1, True), (False, 64, 8, True), (False, 64, 8, False),
                                   (True, 128, 4, True), (False, 32, 2, False)):
        ptx = compile_for_sm90(_quant_decode_kernel, sig, {"HALF": 32, "W2": w2, "BLOCK_W": w2,
                                                           "BLOCK_T": block_t(w2, gb), "GB": gb, "MID": mid,
                                                           "OUT": out, "SOFTCAP": softcap, "STATE": state})
        assert "ex2.approx" in ptx                                        # the online softmax's exp


def test_the_kernel_is_not_specialized_on_what_changes_every_step():
    """The positions written (T) and the key mask's row stride are never specialized on (`do_not_specialize`):
    otherwise the first step whose T is a multiple of 16 compiles the kernel again, mid-run."""
    pytest.importorskip("triton")
    from engine.models._quant_decode_triton import _quant_decode_kernel

    held = {p.name for p in _quant_decode_kernel.params if p.do_not_specialize}
    assert held == {"T", "valid_b"}


@requires_cuda
def test_cuda_decode_steps_reuse_one_compiled_kernel():
    """Decode steps at T = 15, 16, 17, 32, 33 (the key mask [b, T] grows with them) run one compiled kernel."""
    assert_self_check_passes(_triton_ready)
    from engine.models._quant_decode_triton import _quant_decode_kernel

    def compiled() -> int:                 # Triton >= 3.2 keeps (kernels, ...) per device, older a dict
        caches = getattr(_quant_decode_kernel, "device_caches", None)
        if caches is None:
            return sum(len(kernels) for kernels in _quant_decode_kernel.cache.values())
        return sum(len(cache[0]) for cache in caches.values())
    gen = torch.Generator().manual_seed(4)
    cfg = QuantConfig(group_size=64)
    b, nkv, S, hd = 4, 2, 40, 128
    dev = torch.device("cuda")
    q = torch.randn(b, nkv * 2, 1, hd, generator=gen).to(dev, torch.float16)
    k = quantize(torch.randn(b, nkv, S, hd, generator=gen).to(dev, torch.float16), cfg)
    v = quantize(torch.randn(b, nkv, S, hd, generator=gen).to(dev, torch.float16), cfg)
    counts = []
    for t in (15, 16, 17, 32, 33):
        valid = torch.ones(b, t, dtype=torch.bool, device=dev)
        assert quantized_decode_attention(q, k, v, t, valid, hd ** -0.5) is not None
        counts.append(compiled())
    assert counts[0] >= 1 and counts == [counts[0]] * len(counts), counts


def test_declines_off_cuda():
    cfg = QuantConfig(group_size=32)
    k = quantize(torch.randn(2, 2, 8, 32), cfg)
    got = quantized_decode_attention(torch.randn(2, 2, 1, 32), k, k, 5, torch.ones(2, 5, dtype=torch.bool), 0.2)
    assert got is None


@requires_cuda
def test_a_rotated_cache_without_its_rotation_is_declined():
    cfg = QuantConfig(group_size=32, rotate=True)
    k = quantize(torch.randn(2, 2, 8, 32, device="cuda"), cfg)
    q, valid = torch.randn(2, 2, 1, 32, device="cuda"), torch.ones(2, 5, dtype=torch.bool, device="cuda")
    assert quantized_decode_attention(q, k, k, 5, valid, 0.2) is None
    assert quantized_decode_attention(q, k, k, 5, valid, 0.2, rotation=cfg) is not None


@requires_cuda
@pytest.mark.parametrize("dtype, rotate, g, L", [(torch.float16, False, 1, 0), (torch.float16, False, 4, 9),
                                                 (torch.bfloat16, True, 2, 0), (torch.float32, False, 8, 3)])
def test_cuda_matches_the_chunked_path(dtype, rotate, g, L):
    assert_self_check_passes(_triton_ready)
    gen = torch.Generator().manual_seed(3)
    cfg = QuantConfig(group_size=64, rotate=rotate)
    b, nkv, S, t, hd = 48, 4, 600, 555, 128
    dev = torch.device("cuda")
    q = torch.randn(b, nkv * g, 1, hd, generator=gen).to(dev, dtype)
    k = quantize(torch.randn(b, nkv, S, hd, generator=gen).to(dev, dtype), cfg)
    v = quantize(torch.randn(b, nkv, S, hd, generator=gen).to(dev, dtype), cfg)
    prefix = tuple(torch.randn(1, nkv, L, hd, generator=gen).to(dev, dtype) for _ in range(2)) if L else None
    valid = (torch.rand(b, L + t, generator=gen) > 0.2).to(dev)
    valid[:, -1] = True
    got = quantized_decode_attention(q, k, v, t, valid, hd ** -0.5, None, cfg if rotate else None, prefix)
    want = _reference(q, k, v, t, valid, hd ** -0.5, None, prefix)
    ulp = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    assert got is not None and got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() <= ulp * want.float().abs().max().item()


@requires_cuda
@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_cuda_executor_takes_the_kernel_for_every_device_segment(tiny_checkpoints, kind, monkeypatch):
    """A 4-bit cache split between a gpu home and a loaded cpu home (shared prefix rows too): every decode
    attention over it runs the fused kernel (none falls back to the chunked path), and the tokens are the
    all-gpu cache's."""
    calls: list[bool] = []

    def spy(*args, **kwargs):
        out = quantized_decode_attention(*args, **kwargs)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(kv_cache, "quantized_decode_attention", spy)
    loaded = load_model(tiny_checkpoints[kind], dtype=torch.float16)
    prefix = make_prompts(1, loaded.config.vocab_size, seed=5, lo=8, hi=9)[0]
    prompts = [prefix + p for p in make_prompts(6, loaded.config.vocab_size, seed=6, lo=1, hi=9)]
    max_new = [6, 3, 6, 5, 2, 6]
    base = dict(gpu_batch_size=3, num_gpu_batches=2, compress_cache=True)
    ref, _ = run_policy(loaded, Policy(**base), prompts, max_new, device="cuda", dtype=torch.float16)
    got, _ = run_policy(loaded, Policy(**base, w_gpu=0.0, w_cpu=1.0, cache_gpu=0.5, cache_cpu=0.5), prompts,
                        max_new, device="cuda", dtype=torch.float16)
    assert calls and all(calls), calls
    assert got == ref


@requires_cuda
def test_cuda_probe_prices_the_kernel_per_kv_head_and_query_head():
    """The calibration probe times the kernel the executor runs and fits both costs (neither clamped to 0)."""
    from engine.calibrate.measure import measure_gpu_quant_attention

    kv_ns, q_ns = measure_gpu_quant_attention(torch.device("cuda"), torch.float16, repeats=3, batch=32, context=64)
    assert kv_ns > 0 and q_ns > 0
