"""`affine_dequant`: the torch path equals the reference unpack+addcmul bit for bit; the Triton path (CUDA, or
Triton's CPU interpreter where Triton is installed) equals the torch path; `engine` never imports Triton."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine.quant import QTensor, QuantConfig, quantize
from engine.quant.kernels import affine_dequant, affine_dequant_torch
from helpers.paths import REPO
from helpers.skips import requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(7, 128), (3, 2, 5, 64), (4, 100), (2, 16), (1, 3, 1, 192), (0, 64)]


def _reference(data: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The unpack + affine lines of the original `dequantize` ([*lead, g, gs])."""
    codes = torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2)           # [*lead, g, gs]
    return torch.addcmul(mn, codes.to(mn.dtype), scale).to(out_dtype)


def _q(shape, dtype, seed=0, group_size=64):
    torch.manual_seed(seed)
    return quantize((torch.randn(shape) * 3 + 0.5).to(dtype), QuantConfig(group_size=group_size))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_path_bit_exact(dtype, shape):
    q = _q(shape, dtype)
    got = affine_dequant(q.data, q.mn, q.scale, dtype)
    ref = _reference(q.data, q.mn, q.scale, dtype)
    assert got.dtype == dtype and got.shape == ref.shape
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_group_size_and_strided_inputs(dtype):
    q = _q((4, 3, 9, 30), dtype, seed=1, group_size=10)                          # half = 5 bytes per group
    for part in (q[:, :, 2:7], q[::2, 1:], q.index_select(2, torch.tensor([8, 0, 3]))):
        assert torch.equal(affine_dequant(part.data, part.mn, part.scale, dtype),
                           _reference(part.data, part.mn, part.scale, dtype))


# int4 checkpoints' groups (AWQ/GPTQ: 128, 64, 32, or -1 = one group per input row of any even width)
CHECKPOINT_GROUPS = [(3, 256, 128), (5, 96, 96), (2, 11008, 11008), (4, 4096, 4096), (3, 384, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width, group", CHECKPOINT_GROUPS)
def test_checkpoint_group_sizes_on_the_torch_path(dtype, rows, width, group):
    q = _q((rows, width), dtype, seed=4, group_size=group)
    assert torch.equal(affine_dequant(q.data, q.mn, q.scale, dtype), _reference(q.data, q.mn, q.scale, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_is_filled_in_place(dtype):
    q = _q((2, 3, 6, 128), dtype, seed=2)
    ref = _reference(q.data, q.mn, q.scale, dtype)                              # [2, 3, 6, 2, 64]
    flat = torch.empty(2, 3, 6, 128, dtype=dtype)                               # [*lead, g*gs]
    got = affine_dequant(q.data, q.mn, q.scale, dtype, out=flat)
    assert got.data_ptr() == flat.data_ptr() and torch.equal(flat, ref.flatten(-2))
    grouped = torch.empty(2, 3, 6, 2, 64, dtype=dtype)                          # [*lead, g, gs]
    affine_dequant(q.data, q.mn, q.scale, dtype, out=grouped)
    assert torch.equal(grouped, ref)
    buf = torch.full((2, 3, 7, 128), 7.0, dtype=dtype)                          # t + 1 positions
    part = q[:, :, :5]
    affine_dequant(part.data, part.mn, part.scale, dtype, out=buf[:, :, :5])
    assert torch.equal(buf[:, :, :5], ref[:, :, :5].flatten(-2))
    assert bool((buf[:, :, 5:] == 7.0).all())                                   # nothing written past the slice


def test_bad_arguments_name_the_argument():
    q = _q((2, 64), torch.float16)
    with pytest.raises(ValueError, match="data"):
        affine_dequant(q.data.to(torch.int16), q.mn, q.scale, torch.float16)
    with pytest.raises(ValueError, match="mn"):
        affine_dequant(q.data, q.mn[:1], q.scale, torch.float16)
    with pytest.raises(ValueError, match="scale dtype"):
        affine_dequant(q.data, q.mn, q.scale.float(), torch.float16)
    with pytest.raises(ValueError, match="out"):
        affine_dequant(q.data, q.mn, q.scale, torch.float16, out=torch.empty(2, 64))
    with pytest.raises(ValueError, match="out must have shape"):
        affine_dequant(q.data, q.mn, q.scale, torch.float16, out=torch.empty(64, 2, dtype=torch.float16))


def test_engine_imports_without_triton():
    code = ("import sys, torch; pre = 'triton' in sys.modules; "
            "import engine, engine.quant, engine.quant.kernels, engine.quant.group, engine.runtime.kv_cache, "
            "engine.models.llama, engine.models.elementwise; "
            "assert pre or 'triton' not in sys.modules, 'engine imported triton'")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


_INTERPRETED = """
import torch
from engine.quant import QTensor, QuantConfig, quantize
from engine.quant.kernels import affine_dequant_torch
from engine.quant._dequant_triton import affine_dequant_triton
torch.manual_seed(0)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    q = quantize((torch.randn(3, 4, 9, 128) * 3).to(dtype))
    buf = torch.zeros(3, 4, 8, 128, dtype=dtype)
    for part, out in ((q, None), (q[:, :, 2:7], None), (q[:, 1:3, :7], None), (q[:, :, :7], buf[:, :, :7])):
        ref = affine_dequant_torch(part.data, part.mn, part.scale, dtype)
        got = affine_dequant_triton(part.data, part.mn, part.scale, dtype, out=out)
        if dtype == torch.float32:   # the interpreter's fma is a mul then an add: within one rounding
            assert torch.allclose(got, ref, rtol=0, atol=2 ** -21 * float(ref.abs().max())), dtype
        else:
            assert torch.equal(got, ref), dtype
    assert torch.equal(buf[:, :, 7], torch.zeros_like(buf[:, :, 7]))
"""


def test_triton_kernel_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_equals_torch_on_cuda(dtype):
    pytest.importorskip("triton")
    from engine.quant._dequant_triton import affine_dequant_triton

    q = _q((4, 8, 33, 128), dtype, seed=3)
    qd = QTensor(*(t.to("cuda") for t in q.parts()), q.shape, q.config, q.dtype)   # sliced on the device below
    buf = torch.zeros(4, 8, 34, 128, dtype=dtype, device="cuda")                 # t + 1 positions
    slices = [(slice(None),), (slice(None), slice(None), slice(0, 20)), (slice(None), slice(2, 5), slice(3, 30)),
              (slice(None, None, 2),)]
    cases = [(qd[i], q[i], None) for i in slices] + [(qd, q, buf[:, :, :33])]
    for part, cpu_part, out in cases:
        data, mn, scale = part.parts()
        cpu_ref = _reference(*cpu_part.parts(), dtype)
        got = affine_dequant_triton(data, mn, scale, dtype, out=out)
        assert torch.equal(got.cpu(), cpu_ref)                                  # fma on the GPU: exact
        assert torch.equal(affine_dequant(data, mn, scale, dtype), got)
        torch_path = affine_dequant_torch(data, mn, scale, dtype)
        if dtype == torch.float32:
            assert torch.allclose(torch_path, got, rtol=0, atol=2 ** -21 * float(got.abs().max()))
        else:
            assert torch.equal(torch_path, got)
    assert got.data_ptr() == buf.data_ptr() and bool((buf[:, :, 33] == 0).all())


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width, group", CHECKPOINT_GROUPS)
def test_triton_checkpoint_group_sizes_on_cuda(dtype, rows, width, group):
    """The kernel takes the group size as a compile-time constant: any even size, bit-exact as on the CPU."""
    pytest.importorskip("triton")
    from engine.quant._dequant_triton import affine_dequant_triton

    q = _q((rows, width), dtype, seed=5, group_size=group)
    data, mn, scale = (t.to("cuda") for t in q.parts())
    out = torch.empty(rows, width, dtype=dtype, device="cuda")
    got = affine_dequant_triton(data, mn, scale, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out.cpu(), _reference(*q.parts(), dtype).flatten(-2))
    assert torch.equal(affine_dequant(data, mn, scale, dtype), got)             # the dispatch takes the kernel
