"""Calibrate: measuring this machine and running trials, the layer between the facade and policy/runtime.

The policy package decides from numbers (pure); this package produces the numbers and the plans, and is
the only engine layer that runs the executor to learn something: `machine` (RAM, devices, identity, cache
folder), `measure` (the hardware microbenchmark), `profile_cache` (the cached `HardwareProfile`), `trial`
(policies run on truncated models), `cpu_dtype` (the faster CPU dtype, measured once) and `planning` (the
one planning path: budgets, the cost model's choice refined by trials, job plans and the plan cache beside
the hardware profile). Arrows: facade -> calibrate -> {policy, runtime, models}; nothing below imports it.
"""
