"""Measured refinement of the cost model ("trials"): run a policy on a 2-layer copy of the model.

`trial_seconds` builds the real `Executor` on a truncated copy of the model (same shapes, fewer decoder
layers, dummy weights), runs a short warm-up block and then one block of the policy's full size (every row
`steps` new tokens), and extrapolates the full model's block time. A hook synchronizes the device at the end
of the embedding's slots and at the end of the first decoder layer's slots of each step, so one decoder
layer is timed: its computes for every GPU batch and the weight loads issued during them (the next
layer's, as in the full model). The window must stop before the last decoder layer: that layer's
slots load the output head (for OPT-30B 0.7 GB of fp16 when it lives on the cpu), a once-per-step cost
the full model pays once, not once per layer. Then
    full step = trial step + (L - l) * (first decoder layer's time in the trial step)
and per-layer times are full step / L (prefill: step 0; decode: the mean step, with the fastest decode
step's layer, so a one-off stall in one step's window is not multiplied by the untimed layers). Trials
under-read resident-cache candidates on the H200 either way: OPT-6.7B 4-bit 64 x 1 trialed at 58-371 tok/s
with the mean and 213-233 with the fastest step, and ran 605-678 in full
(benchmarks/results/h200/policy_validation*.json). The trial's
prompt is the workload's mean prompt; its decode context is s + steps / 2 (the full run's mean is
s + n / 2). `trial_estimate` turns the numbers into a `PolicyEstimate` that records both the cost
model's prediction and the trial's measurement.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from engine.models.config import ModelConfig
from engine.models.dummy_source import DummySource
from engine.models.loader import LoadedModel
from engine.models.registry import build_family
from engine.policy.cost_model import Workload
from engine.policy.estimate import Budgets, PolicyEstimate
from engine.policy.policy import Policy
from engine.runtime.selector import GreedyToEnd

TRIAL_LAYERS = 2
TRIAL_STEPS = 4


class TrialTimes(NamedTuple):
    """Extrapolated seconds per decoder layer of the full model: prefill (whole block) and one decode step."""

    prefill_s_per_layer: float
    decode_s_per_layer_step: float


def truncated_model(config: ModelConfig, layers: int, dtype: torch.dtype, name: str = "trial") -> LoadedModel:
    """`config` with `layers` decoder layers and deterministic dummy weights (no files)."""
    if layers < 1:
        raise ValueError(f"truncated_model: layers must be >= 1, got {layers}")
    small = replace(config, num_hidden_layers=layers)
    digest = hashlib.sha256(f"{name}:{small.to_dict()}".encode()).hexdigest()[:32]
    return LoadedModel(small, build_family(small), DummySource(name, dtype), None, digest, dtype)


class _LayerClock:
    """An executor `on_action` hook: per step, the wall time of the first decoder layer's slots, from the end
    of the embedding's last slot to the end of the first decoder layer's last slot (a slot ends with its
    `sync` action; the device is synchronized at both ends). Specs run embed, [attention, mlp] x layers,
    head. (Timing events on the compute stream instead of synchronizing were tried on the H200 and were no
    closer: OPT-6.7B trials at 0.69x and 0.26x of the full runs' throughput with events, 0.90x and 0.28x
    synchronized, for the same kinds of policies; benchmarks/results/h200/policy_validation*.json.)"""

    def __init__(self, device: torch.device, num_batches: int, specs_per_layer: int = 2):
        self.device, self.last_k, self.end_j = device, num_batches - 1, specs_per_layer
        self.start: dict[int, float] = {}
        self.end: dict[int, float] = {}

    def __call__(self, action) -> None:
        if action.verb != "sync" or action.k != self.last_k or action.j not in (0, self.end_j):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if action.j == 0:
            self.start[action.i] = time.perf_counter()
        elif action.i in self.start:
            self.end[action.i] = time.perf_counter()

    @property
    def layer_s(self) -> dict[int, float]:
        """Seconds of the timed layer per step index (steps whose window closed)."""
        return {i: end - self.start[i] for i, end in self.end.items()}


def extrapolate(step_s: float, layer_s: float, trial_layers: int, num_layers: int) -> float:
    """Seconds of one full-model step from a trial step of `step_s` whose first decoder layer took `layer_s`."""
    return step_s + (num_layers - trial_layers) * layer_s


def _clocked_run(loaded: LoadedModel, policy: Policy, prompts: list[list[int]], steps: int, device: torch.device,
                 dtype: torch.dtype, **executor_kwargs) -> tuple[dict[int, float], dict[str, float]]:
    """A warm-up block (buffers, kernels), then one block of `steps` decode steps under `_LayerClock`, on the
    real executor: (one decoder layer's seconds per step index, the executor's stats of that block)."""
    if loaded.config.num_hidden_layers < 2:
        raise ValueError("a clocked run needs >= 2 decoder layers (the last one also loads the head)")
    from engine.runtime.executor import Executor

    executor = Executor(loaded, policy, device=device, dtype=dtype, **executor_kwargs)
    try:
        executor.timing = True
        executor.generate_block(prompts, [2] * len(prompts), GreedyToEnd())
        clock = _LayerClock(device, -(-len(prompts) // policy.gpu_batch_size))
        executor.on_action = clock
        executor.generate_block(prompts, [steps + 1] * len(prompts), GreedyToEnd())
        stats = dict(executor.stats)
    finally:
        executor.close()
    layer_s = clock.layer_s
    if 0 not in layer_s or not any(i >= 1 for i in layer_s):
        raise RuntimeError(f"trial of {policy} measured no complete step")
    return layer_s, stats


def trial_seconds(config: ModelConfig, policy: Policy, workload: Workload, device: torch.device | str,
                  dtype: torch.dtype, budgets: Budgets | None = None, *, layers: int = TRIAL_LAYERS,
                  steps: int = TRIAL_STEPS, disk_dir: Path | None = None) -> TrialTimes:
    """Run `policy` for one block on a `layers`-layer copy of `config` on `device`; return the full model's
    extrapolated seconds per layer (prefill of the block; one decode step).

    `budgets` are the run's hard limits (the trial needs less: only `layers` layers' weights and cache);
    None: unlimited. Raises what the executor raises (BudgetExceeded, out of memory) when it does not run.
    """
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (workload.prompt_len,), generator=g).tolist()
               for _ in range(policy.block_size)]
    layer_s, stats = _clocked_run(
        truncated_model(config, layers, dtype), policy, prompts, steps, device, dtype,
        gpu_memory=budgets.gpu_bytes if budgets is not None else None,
        cpu_memory=budgets.cpu_bytes if budgets is not None else None, disk_dir=disk_dir)
    L = config.num_hidden_layers
    decode_steps = [i for i in layer_s if i >= 1]
    prefill = extrapolate(stats["prefill_s"], layer_s[0], layers, L)
    # the fastest decode step's layer: a one-off stall in one step's window would be multiplied by the
    # L - layers layers the trial does not run
    decode_layer = min(layer_s[i] for i in decode_steps)
    decode = extrapolate(stats["decode_s"] / max(1, stats["steps"] - 1), decode_layer, layers, L)
    return TrialTimes(prefill / L, decode / L)


def slot_seconds(config: ModelConfig, policy: Policy, device: torch.device | str, dtype: torch.dtype, *,
                 prompt_len: int = 8, steps: int = 4, layers: int = TRIAL_LAYERS) -> tuple[float, float]:
    """(prefill, decode) seconds per (decoder layer, GPU batch) slot of the real executor running `policy`
    on a `layers`-layer copy of `config`: for a tiny config, the executor's own per-slot cost."""
    prompts = [list(range(3, 3 + prompt_len))] * policy.block_size
    layer_s, _ = _clocked_run(truncated_model(config, layers, dtype, name="slot-probe"), policy, prompts, steps,
                              torch.device(device), dtype)
    slots = policy.num_gpu_batches
    return layer_s[0] / slots, min(t for i, t in layer_s.items() if i >= 1) / slots


def full_block(config: ModelConfig, times: TrialTimes, gen_len: int, block_size: int) -> tuple[float, float, float]:
    """(prefill seconds, decode seconds, generated tokens/s) of one full-model block from a trial's times."""
    L = config.num_hidden_layers
    prefill_s = L * times.prefill_s_per_layer
    decode_s = L * (gen_len - 1) * times.decode_s_per_layer_step
    return prefill_s, decode_s, block_size * gen_len / (prefill_s + decode_s)


def trial_estimate(config: ModelConfig, predicted: PolicyEstimate, workload: Workload, times: TrialTimes,
                   trial_info: dict | None = None) -> PolicyEstimate:
    """`predicted` with its times and throughput replaced by the trial's extrapolation; the context keeps the
    cost model's numbers under "predicted" and the trial's under "trial"."""
    prefill_s, decode_s, tokens_per_s = full_block(config, times, workload.gen_len, predicted.policy.block_size)
    context = dict(predicted.context)
    context["predicted"] = {"tokens_per_s": predicted.predicted_tokens_per_s, "prefill_s": predicted.prefill_s,
                            "decode_s": predicted.decode_s}
    context["trial"] = {"tokens_per_s": tokens_per_s, "prefill_s_per_layer": times[0],
                        "decode_s_per_layer_step": times[1], **(trial_info or {})}
    return replace(predicted, predicted_tokens_per_s=tokens_per_s, prefill_s=prefill_s, decode_s=decode_s,
                   context=context)


def best_by_trials(config: ModelConfig, candidates: list[PolicyEstimate], workload: Workload,
                   device: torch.device | str, dtype: torch.dtype, budgets: Budgets | None = None, *,
                   time_budget_s: float = 20.0, layers: int = TRIAL_LAYERS, steps: int = TRIAL_STEPS,
                   disk_dir: Path | None = None) -> PolicyEstimate:
    """Trial each candidate (best predicted first) and return the one with the highest measured throughput,
    its estimate carrying the trial's numbers; `context["trials"]` lists every candidate's prediction and
    measurement (or error, or "skipped" once `time_budget_s` of trials has passed: the first always runs).
    When no trial runs, the best predicted candidate is returned with the errors recorded."""
    if not candidates:
        raise ValueError("best_by_trials: no candidates")
    start = time.perf_counter()
    measured: list[PolicyEstimate] = []
    log: list[dict] = []
    for n, cand in enumerate(candidates):
        entry = {"policy": cand.policy.to_dict(), "predicted_tokens_per_s": cand.predicted_tokens_per_s}
        log.append(entry)
        if n > 0 and time.perf_counter() - start > time_budget_s:
            entry["skipped"] = f"trial time budget of {time_budget_s:.0f} s spent"
            continue
        t0 = time.perf_counter()
        try:
            times = trial_seconds(config, cand.policy, workload, device, dtype, budgets, layers=layers, steps=steps,
                                  disk_dir=disk_dir)
        except (torch.OutOfMemoryError, RuntimeError, ValueError) as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            continue
        est = trial_estimate(config, cand, workload, times, {"layers": layers, "steps": steps,
                                                              "wall_s": time.perf_counter() - t0})
        entry["trial_tokens_per_s"] = est.predicted_tokens_per_s
        measured.append(est)
    best = max(measured, key=lambda e: e.predicted_tokens_per_s) if measured else candidates[0]
    context = dict(best.context)
    context["trials"] = log
    context["selected_by"] = "trial" if measured else "model (no trial ran)"
    return replace(best, context=context)
