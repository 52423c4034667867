"""Affine expressions over the six free placement fractions of a `Policy`, as numpy vectors.

An expression is an array [7]: coefficients of (w_gpu, w_cpu, cache_gpu, cache_cpu, act_gpu, act_cpu)
then a constant. The disk shares are derived (1 - gpu - cpu), so every cost and memory term of the cost
model is affine in these six numbers: the LP of `search` and the evaluation of a fixed policy read the
same vectors.
"""
from __future__ import annotations

import numpy as np

from engine.policy.policy import Policy

VARS: tuple[str, ...] = ("w_gpu", "w_cpu", "cache_gpu", "cache_cpu", "act_gpu", "act_cpu")
NUM_VARS = len(VARS)
CLASSES: tuple[str, ...] = ("w", "cache", "act")


def lin(const: float = 0.0, **coefs: float) -> np.ndarray:
    """An affine expression: `const + sum(coef * var)`, vars named as in VARS."""
    expr = np.zeros(NUM_VARS + 1)
    for name, value in coefs.items():
        expr[VARS.index(name)] = value
    expr[NUM_VARS] = const
    return expr


def share(tensor: str, tier: str) -> np.ndarray:
    """The fraction of tensor class `tensor` ("w", "cache", "act") on `tier`: "gpu", "cpu", "disk", or
    "off" (not on the gpu: cpu + disk)."""
    if tensor not in CLASSES:
        raise ValueError(f"unknown tensor class {tensor!r}; known: {CLASSES}")
    gpu, cpu = f"{tensor}_gpu", f"{tensor}_cpu"
    if tier == "gpu":
        return lin(**{gpu: 1.0})
    if tier == "cpu":
        return lin(**{cpu: 1.0})
    if tier == "disk":
        return lin(1.0, **{gpu: -1.0, cpu: -1.0})
    if tier == "off":
        return lin(1.0, **{gpu: -1.0})
    raise ValueError(f"unknown tier {tier!r}; known: gpu, cpu, disk, off")


def const(value: float) -> np.ndarray:
    return lin(value)


def placement_vector(policy: Policy) -> np.ndarray:
    """The policy's six free fractions, in VARS order: [6]."""
    return np.array([getattr(policy, name) for name in VARS], dtype=float)


def evaluate(expr: np.ndarray, x: np.ndarray) -> float:
    """Value of `expr` at placement `x` [6]."""
    return float(expr[:NUM_VARS] @ x + expr[NUM_VARS])
