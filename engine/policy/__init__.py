"""Placement policy, the pure decision: the frozen `Policy`, `HardwareProfile` (data), the cost and memory
model (incl. the executor's working-memory formula, `working`), the LP search and its typed estimates.

Nothing here measures or runs anything: measuring the machine, trials and `choose_policy` (what
`LLM(policy="auto")` calls) are `engine.calibrate`, the layer above. Entry point of the maths:
`engine.policy.search.search` (the LP search, returning a `PolicyEstimate`).
"""
from engine.policy.policy import Policy

__all__ = ["Policy"]
