"""Calibrate: measuring this machine and running trials, the layer between the facade and policy/runtime.

The policy package decides from numbers (pure); this package produces the numbers and the plans, and is
the only engine layer that runs the executor to learn something: `machine` (RAM, devices, identity, cache
folder), `measure` (the hardware microbenchmark), `profile_cache` (the cached `HardwareProfile`), `trial`
(policies run on truncated models), `auto` (`choose_policy`: search, then trials on a GPU), `cpu_dtype`
(the faster CPU dtype, measured once), `planning` and `planner` (a job's plan, chosen once and cached beside
the hardware profile). Arrows: facade -> calibrate -> {policy, runtime, models}; nothing below imports it.
"""
