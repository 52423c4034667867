"""Group-wise 4-bit asymmetric quantization as paired pure functions (FlexGen section 5).

`quantize(x, config) -> QTensor` and `dequantize(q) -> Tensor` round-trip with an absolute error of at most
half a step per element: (max - min) / (2 * 15) of the element's group, plus rounding of min/scale to the
tensor's dtype. Both run on whatever device the input lives on, with batched torch ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant.config import QuantConfig
from engine.quant.qtensor import QTensor, scale_dtype


def quantize(x: torch.Tensor, config: QuantConfig = QuantConfig()) -> QTensor:
    """x [*lead, d] float -> QTensor with groups of config.group_size along the last dim."""
    *lead, d = x.shape
    gs = config.group_size
    groups = -(-d // gs)
    xf = x.float()
    if groups * gs != d:
        xf = F.pad(xf, (0, groups * gs - d))                               # pad with zeros to whole groups
    xf = xf.reshape(*lead, groups, gs)                                     # [*lead, g, gs]
    mn = xf.amin(dim=-1, keepdim=True)                                     # [*lead, g, 1]
    mx = xf.amax(dim=-1, keepdim=True)
    scale = (mx - mn) / config.levels
    mn_s, scale_s = mn.to(scale_dtype(x.dtype)), scale.to(scale_dtype(x.dtype))  # stored precision
    inv = torch.where(scale_s.float() > 0, 1.0 / scale_s.float(), torch.zeros_like(scale))
    codes = ((xf - mn_s.float()) * inv).round_().clamp_(0, config.levels).to(torch.uint8)  # [*lead, g, gs]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)                    # [*lead, g, gs/2]
    return QTensor(packed.contiguous(), mn_s.contiguous(), scale_s.contiguous(), torch.Size(x.shape), config,
                   x.dtype)


def dequantize(q: QTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """QTensor -> dense tensor of q.shape in q.dtype on q.device (written into `out` when given)."""
    *lead, d = q.shape
    low = q.data & 0x0F                                                    # [*lead, g, gs/2]
    high = q.data >> 4
    codes = torch.stack((low, high), dim=-1).flatten(-2)                   # [*lead, g, gs]
    dense = torch.addcmul(q.mn, codes.to(q.mn.dtype), q.scale).to(q.dtype)  # [*lead, g, gs]
    dense = dense.flatten(-2)[..., :d]                                     # [*lead, d]
    if out is None:
        return dense
    return out.copy_(dense)
