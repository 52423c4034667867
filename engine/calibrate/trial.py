"""Measured refinement of the cost model ("trials"): run a policy on truncated copies of the model.

`trial_seconds` builds the real `Executor` on two truncated copies of the model (same shapes, `lo` and
`hi` decoder layers, default 2 and 6, dummy weights). On each it runs a short warm-up block and then one
block of the policy's full size (every row `steps` new tokens) with the executor's step times (each from one
step's token pick to the next, as in a full run). The copies differ only by `hi - lo` decoder
layers in the middle of the model, so the difference of their step times is what those layers cost in a
step that runs as the full model's does: host launches overlapped with device work, each layer's slots
issuing the next layer's weight loads, the embedding, the head (and the head's weight load) and the
per-step sampling the same in both and cancelled. Then
    per layer = (step(hi) - step(lo)) / (hi - lo),   full step = step(lo) + (L - lo) * per layer
for the prefill (step 0) and for a decode step (each copy's fastest decode step, so a one-off stall is
not multiplied by the layers the trial does not run); per-layer times are full step / L. Noise in the
step times is multiplied by (L - lo) / (hi - lo): 15x for OPT-6.7B with copies of 2 and 4 layers, 7.5x
with 2 and 6 (hi never exceeds L). A clock that synchronizes the device around one decoder layer
(`_LayerClock`) times host launches and device work in series (on an H200 it reads OPT-6.7B's resident
policies at 0.3-0.6x of their full runs), so it only measures the executor's per-slot host cost on tiny
configs (`slot_seconds`), where the device work is negligible. The trial's prompt is the workload's mean
prompt, its shared prefix the workload's (`trial_prompts`: the same leading tokens in every row, computed
once per GPU batch as in the run); its decode context is s + steps / 2 (the full run's mean is s + n / 2).
`trial_estimate` turns the numbers into a `PolicyEstimate` that records both the cost model's prediction and
the trial's measurement; `best_by_trials` ranks candidates by their trials bounded by their predictions (`bounded`).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from engine.models.config import ModelConfig
from engine.models.dummy_source import DummySource
from engine.models.loader import LoadedModel
from engine.models.registry import build_family
from engine.policy.cost_model import Workload, rows_filled
from engine.policy.estimate import Budgets, PolicyEstimate
from engine.policy.memory import runs_ahead
from engine.policy.policy import Policy
from engine.runtime.executor import Executor
from engine.runtime.schedule import Action, batch_order
from engine.runtime.selector import GreedyToEnd

TRIAL_LAYERS = (2, 6)     # decoder layers of the two truncated copies a trial runs
TRIAL_STEPS = 4
SLOT_PROBE_LAYERS = 2


class TrialTimes(NamedTuple):
    """Extrapolated seconds per decoder layer of the full model: prefill (whole block) and one decode step;
    `detail` the measured step seconds of each copy (for logs)."""

    prefill_s_per_layer: float
    decode_s_per_layer_step: float
    detail: dict | None = None


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
    head. Host launches and device work of the layer run in series inside the window: right for the
    slot probes' tiny configs (negligible device work), not for timing a real model's layer."""

    def __init__(self, device: torch.device, num_batches: int, num_specs: int, specs_per_layer: int = 2):
        self.device, self.num_batches, self.num_specs, self.end_j = device, num_batches, num_specs, specs_per_layer
        self.start: dict[int, float] = {}
        self.end: dict[int, float] = {}

    def __call__(self, action) -> None:
        if action.verb != "sync" or action.j not in (0, self.end_j):
            return
        if action.k != batch_order(action.i, action.j, self.num_specs, self.num_batches)[-1]:
            return                                   # not the layer's last slot
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


def per_layer(step_hi: float, step_lo: float, hi: int, lo: int) -> float:
    """Seconds one decoder layer adds to a step: the difference of two copies' step times per layer they
    differ by. A non-positive difference (noise swamping a tiny layer) falls back to the larger copy's
    step spread over its layers, an overestimate."""
    diff = (step_hi - step_lo) / (hi - lo)
    return diff if diff > 0 else step_hi / hi


def extrapolate(step_lo: float, layer_s: float, lo: int, num_layers: int) -> float:
    """Seconds of one full-model step from the `lo`-layer copy's step of `step_lo` seconds and `layer_s`
    seconds per further decoder layer."""
    return step_lo + (num_layers - lo) * layer_s


def step_seconds(loaded: LoadedModel, policy: Policy, prompts: list[list[int]], steps: int, device: torch.device,
                 dtype: torch.dtype, on_action: Callable[[Action], None] | None = None,
                 **executor_kwargs) -> list[float]:
    """A warm-up block (buffers, kernels), then one block of `steps` decode steps on the real executor with
    the `on_action` hook: that block's seconds per step (index 0 the prefill)."""
    executor = Executor(loaded, policy, device=device, dtype=dtype, **executor_kwargs)
    try:
        executor.generate_block(prompts, [2] * len(prompts), GreedyToEnd())
        executor.on_action = on_action
        executor.generate_block(prompts, [steps + 1] * len(prompts), GreedyToEnd())
        return list(executor.step_s)
    finally:
        executor.close()


def _clocked_run(loaded: LoadedModel, policy: Policy, prompts: list[list[int]], steps: int, device: torch.device,
                 dtype: torch.dtype) -> dict[int, float]:
    """`step_seconds` under `_LayerClock`: one decoder layer's seconds per step index."""
    if loaded.config.num_hidden_layers < 2:
        raise ValueError("a clocked run needs >= 2 decoder layers (the last one also loads the head)")
    clock = _LayerClock(device, -(-len(prompts) // policy.gpu_batch_size), len(loaded.family.layer_specs()))
    step_seconds(loaded, policy, prompts, steps, device, dtype, on_action=clock)
    layer_s = clock.layer_s
    if 0 not in layer_s or not any(i >= 1 for i in layer_s):
        raise RuntimeError(f"clocked run of {policy} measured no complete step")
    return layer_s


def trial_prompts(config: ModelConfig, workload: Workload, rows: int) -> list[list[int]]:
    """`rows` random prompts of the workload's mean length whose first `workload.shared_prefix_len` tokens are
    the same in every row (the rest differ), so the executor shares a prefix exactly as in the run."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, config.vocab_size, (workload.shared_prefix_len,), generator=g).tolist()
    own = workload.prompt_len - workload.shared_prefix_len
    return [prefix + torch.randint(3, config.vocab_size, (own,), generator=g).tolist() for _ in range(rows)]


def copy_policy(policy: Policy, layers: int, num_layers: int) -> Policy:
    """`policy` for a copy of `layers` of the model's `num_layers` decoder layers: its `w_gpu_extra` tensors (the
    first layers' extra tensors) scaled to the copy, so the copies' per-layer difference sees them in the
    model's proportion."""
    if not policy.w_gpu_extra:
        return policy
    return replace(policy, w_gpu_extra=round(policy.w_gpu_extra * layers / max(1, num_layers)))


def trial_seconds(config: ModelConfig, policy: Policy, workload: Workload, device: torch.device | str,
                  dtype: torch.dtype, budgets: Budgets | None = None, *,
                  layers: tuple[int, int] = TRIAL_LAYERS, steps: int = TRIAL_STEPS,
                  disk_dir: Path | None = None) -> TrialTimes:
    """Run `policy` for one block on each of two truncated copies of `config` (`layers` = (lo, hi) decoder
    layers; hi at most the model's own count when that is above lo) on `device`; return the full model's
    extrapolated seconds per layer (prefill of the block; one decode step), with both copies' step seconds
    in `detail`.

    `budgets` are the run's hard limits (the trial needs less: only `hi` layers' weights and cache);
    None: unlimited. Raises what the executor raises (BudgetExceeded, out of memory) when it does not run.
    """
    lo, hi = layers
    if not 1 <= lo < hi:
        raise ValueError(f"trial_seconds: layers must be (lo, hi) with 1 <= lo < hi, got {layers}")
    hi = max(lo + 1, min(hi, config.num_hidden_layers))       # a copy larger than the model measures nothing more
    device = torch.device(device)
    prompts = trial_prompts(config, workload, policy.block_size)
    kwargs = dict(gpu_memory=budgets.gpu_bytes if budgets is not None else None,
                  cpu_memory=budgets.cpu_bytes if budgets is not None else None, disk_dir=disk_dir)
    L = config.num_hidden_layers
    runs = {n: step_seconds(truncated_model(config, n, dtype), copy_policy(policy, n, L), prompts, steps, device,
                            dtype, **kwargs)
            for n in (lo, hi)}
    if any(len(t) < 2 for t in runs.values()):
        raise RuntimeError(f"trial of {policy} measured no decode step")
    prefill = extrapolate(runs[lo][0], per_layer(runs[hi][0], runs[lo][0], hi, lo), lo, L)
    # each copy's fastest decode step: a one-off stall would be multiplied by the layers the trial skips
    dec_lo, dec_hi = min(runs[lo][1:]), min(runs[hi][1:])
    decode = extrapolate(dec_lo, per_layer(dec_hi, dec_lo, hi, lo), lo, L)
    return TrialTimes(prefill / L, decode / L, {f"step_s_{n}_layers": t for n, t in runs.items()})


def slot_seconds(config: ModelConfig, policy: Policy, device: torch.device | str, dtype: torch.dtype, *,
                 prompt_len: int = 8, steps: int = 4, layers: int = SLOT_PROBE_LAYERS) -> tuple[float, float]:
    """(prefill, decode) seconds per (decoder layer, GPU batch) slot of the real executor running `policy`
    on a `layers`-layer copy of `config`: for a tiny config, the executor's own per-slot cost."""
    prompts = [list(range(3, 3 + prompt_len))] * policy.block_size
    layer_s = _clocked_run(truncated_model(config, layers, dtype, name="slot-probe"), policy, prompts, steps,
                           torch.device(device), dtype)
    slots = policy.num_gpu_batches
    return layer_s[0] / slots, min(t for i, t in layer_s.items() if i >= 1) / slots


def full_block(config: ModelConfig, times: TrialTimes, gen_len: int, block_size: int,
               prefill_in_series: float = 1.0, slack: float = 0.0, filled: float = 1.0) -> tuple[float, float, float]:
    """(prefill seconds, decode seconds, generated tokens/s) of one full-model block from a trial's times, the
    tokens/s over a run whose blocks' rows are `filled` (`cost_model.rows_filled`).
    `prefill_in_series` < 1 (the ahead prefill over several blocks, `memory.runs_ahead`): a block's share of a
    prefill run in series; each block but the last (1 - `prefill_in_series` of them) carries the next one's
    prefill on its decode, which hides `slack` of its own time's worth of it (`cost_model.decode_slack`: the
    share of a step neither the device's compute nor the host fills) and pays the remainder. A trial runs single
    blocks, so it cannot see this overlap itself."""
    L = config.num_hidden_layers
    prefill = L * times.prefill_s_per_layer
    prefill_s = prefill * prefill_in_series
    decode_s = L * (gen_len - 1) * times.decode_s_per_layer_step
    carried = (1.0 - prefill_in_series) * max(0.0, prefill - slack * decode_s)
    return prefill_s, decode_s + carried, filled * block_size * gen_len / (prefill_s + decode_s + carried)


def series_share(policy: Policy, workload: Workload) -> float:
    """A block's share of a prefill the executor runs in series for this workload: 1, or with the ahead prefill
    over B blocks 1 / B (0 when the rows are unbounded)."""
    if not runs_ahead(policy, workload.gen_len, workload.num_prompts):
        return 1.0
    return 0.0 if workload.num_prompts is None else 1.0 / -(-workload.num_prompts // policy.block_size)


def trial_estimate(config: ModelConfig, predicted: PolicyEstimate, workload: Workload, times: TrialTimes,
                   trial_info: dict | None = None) -> PolicyEstimate:
    """`predicted` with its times and throughput replaced by the trial's extrapolation (a policy with the
    ahead prefill: as `full_block` charges it, with the search's `context["decode_slack"]`, 0 when absent:
    all of the carried prefill paid); the context keeps the cost model's numbers under "predicted"
    and the trial's under "trial"."""
    prefill_s, decode_s, tokens_per_s = full_block(config, times, workload.gen_len, predicted.policy.block_size,
                                                   series_share(predicted.policy, workload),
                                                   predicted.context.get("decode_slack", 0.0),
                                                   rows_filled(predicted.policy.block_size, workload.num_prompts))
    context = dict(predicted.context)
    context["predicted"] = {"tokens_per_s": predicted.predicted_tokens_per_s, "prefill_s": predicted.prefill_s,
                            "decode_s": predicted.decode_s}
    context["trial"] = {"tokens_per_s": tokens_per_s, "prefill_s_per_layer": times.prefill_s_per_layer,
                        "decode_s_per_layer_step": times.decode_s_per_layer_step, **(times.detail or {}),
                        **(trial_info or {})}
    return replace(predicted, predicted_tokens_per_s=tokens_per_s, prefill_s=prefill_s, decode_s=decode_s,
                   context=context)


def bounded(trial: PolicyEstimate, predicted: PolicyEstimate) -> PolicyEstimate:
    """The trial's estimate, or the cost model's where the trial reads faster than it. The cost model is an
    optimistic bound (every channel at its measured peak rate, transfers and compute fully overlapped): on
    an H200, none of 33 OPT-6.7B policies measured in full ran above 1.02x its prediction, while
    host-bound trials read up to 2.15x theirs when the host ran fast during the trial
    (`benchmarks/policy/policy_validation.py`, `benchmarks/policy/trial_accuracy.py`). A trial above the bound
    measured the host, not the policy."""
    if trial.predicted_tokens_per_s <= predicted.predicted_tokens_per_s:
        return trial
    context = dict(trial.context)
    context["trial"] = dict(context["trial"], bounded_by_model=True)
    return replace(trial, predicted_tokens_per_s=predicted.predicted_tokens_per_s, prefill_s=predicted.prefill_s,
                   decode_s=predicted.decode_s, context=context)


def best_by_trials(config: ModelConfig, candidates: list[PolicyEstimate], workload: Workload,
                   device: torch.device | str, dtype: torch.dtype, budgets: Budgets | None = None, *,
                   time_budget_s: float = 60.0, layers: tuple[int, int] = TRIAL_LAYERS, steps: int = TRIAL_STEPS,
                   disk_dir: Path | None = None) -> PolicyEstimate:
    """Trial each candidate (best predicted first) and return the one with the highest measured throughput
    bounded by its prediction (`bounded`), its estimate carrying those numbers; `context["trials"]` lists
    every candidate's prediction and measurement (or error, or "skipped" once `time_budget_s` of trials has
    passed: the first always runs). When no trial runs, the best predicted candidate is returned with the
    errors recorded."""
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
        entry["trial_wall_s"] = est.context["trial"]["wall_s"]
        est = bounded(est, cand)
        entry["score_tokens_per_s"] = est.predicted_tokens_per_s
        measured.append(est)
    best = max(measured, key=lambda e: e.predicted_tokens_per_s) if measured else candidates[0]
    context = dict(best.context)
    context["trials"] = log
    context["selected_by"] = "trial" if measured else "model (no trial ran)"
    return replace(best, context=context)
