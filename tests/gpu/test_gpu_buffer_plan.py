"""On CUDA: what the executor allocates is the memory model's buffer plan, name for name and byte for byte
(pinned staging, relays, host-attention staging and the embedding and head held on the device included), and
the device's real peak stays within the budget the memory model gives (the plan's gpu bytes, the working
memory and the device memory the executor uses without reserving it), for the grid of policies on a small
model of each kind (skipped without a GPU)."""
from __future__ import annotations

import pytest

from helpers.buffer_plans import CUDA_KINDS, GRID, cuda_case
from helpers.skips import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


@pytest.mark.parametrize("name", sorted(CUDA_KINDS))
@pytest.mark.parametrize("case", sorted(GRID))
def test_cuda_allocates_the_plan_within_its_budget(name, case, tmp_path):
    got = cuda_case(name, case, tmp_path)
    assert got["differences"] == []
    assert got["report_matches"]
    assert got["within_budget"], f"device peak {got['device_peak_bytes']} > the memory model's {got['budget_bytes']}"
