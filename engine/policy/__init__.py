"""Placement policy: the frozen `Policy`, the measured `HardwareProfile`, the cost model and the LP search.

Entry points: `engine.calibrate.auto.choose_policy` (what `LLM(policy="auto")` calls) and
`engine.policy.search.search` (the LP search, returning a `PolicyEstimate`).
"""
from engine.policy.policy import Policy

__all__ = ["Policy"]
