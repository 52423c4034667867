"""The fused elementwise kernels' parity rule against the torch ops (engine/models/elementwise.py says why):
float16/bfloat16 within one ulp where the second factor is exactly 1, otherwise within two ulps and one for at
least 99.9% of the elements; float32 within 2^-20 (`close_to_torch`). Imported by the tests and by the scripts
they run under Triton's interpreter."""
from __future__ import annotations

import torch

from engine.models.elementwise_torch import close_to_torch, ulp_spacing


def one_ulp_share(got: torch.Tensor, want: torch.Tensor) -> float:
    """Share of the elements of `got` within one ulp of `want`."""
    a, b = got.double(), want.double()
    return float(((a - b).abs() <= ulp_spacing(b, want.dtype)).double().mean()) if b.numel() else 1.0


def check_close(got: torch.Tensor, want: torch.Tensor, exact_factor: bool) -> None:
    """The kernels' parity rule (this module's docstring); the 99.9% share checked on 10,000 elements or more."""
    if want.dtype == torch.float32 or exact_factor:
        assert close_to_torch(got, want), float((got.double() - want.double()).abs().max())
    else:
        assert close_to_torch(got, want, ulps=2)
        assert want.numel() < 10_000 or one_ulp_share(got, want) >= 0.999
