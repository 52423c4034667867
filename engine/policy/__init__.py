"""Placement policy, the pure decision: the frozen `Policy`, `HardwareProfile` (data), the model's weights as
data (`layout`), the buffer plan every executor allocates from (`buffers`), the cost and memory model (the
plan's sums and the executor's working-memory formula, `working`), the LP search and its typed estimates. No
torch, no model building, no storage or runtime (an import contract in pyproject.toml).

Nothing here measures or runs anything: measuring the machine, trials and `choose_policy` (what
`LLM(policy="auto")` calls) are `engine.calibrate`, the layer above. Entry point of the maths:
`engine.policy.search.search` (the LP search, returning a `PolicyEstimate`).
"""
from engine.policy.policy import Policy

__all__ = ["Policy"]
