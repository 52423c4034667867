"""`EngineStats`: where an engine's time went and how much memory its tiers held, counted as it runs.

The facade (`engine.llm.LLM.stats`) owns one and adds to it; a caller measures a stretch of work as the
difference of two snapshots (`after.since(before)`). Pure Python: no torch, cheap enough to be always on.

Seconds are wall clock on the host and do not overlap: `load_s` reading the model (the facade's constructor);
`place_s` building executors (placing the weights on the tiers); `plan_s` choosing plans (the cost model's
search, trials); `prefill_s` / `decode_s` the executor's prefill step and decode steps less the two parts
charged apart inside them: `grammar_mask_s` (constrained decoding: the grammar's token masks and its advance per
chosen token; `grammar_advance_s` is the advance's part of it) and `callback_s` (the caller's `on_finished`
hook). A step ends when its tokens are chosen, which reads them back to the host, so on CUDA a step's device
work is inside its own step. `peak_bytes`: the most each tier (gpu, cpu, disk) held, as the executor's budget
counts it (weights, cache, working memory: what the cost model's peak memory predicts), during the latest
generate/stream call; `device_peak_bytes`: torch's peak allocated bytes on CUDA at the end of that call (since
the process began or torch's peak was last reset; None on a CPU).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

SECONDS = ("load_s", "place_s", "plan_s", "prefill_s", "decode_s", "grammar_mask_s", "callback_s")
TIERS = ("gpu", "cpu", "disk")


@dataclass
class EngineStats:
    """Counters of one engine (see module docstring); `blocks`, `steps` and `generated_tokens` count the
    blocks run, their steps (prefill included) and the tokens chosen; `prefilled_ahead` the blocks whose
    prefill ran on the previous block's decode steps (`Policy.prefill_ahead`: their prefill_s is 0, the
    prefill's time is inside the previous block's decode_s)."""

    load_s: float = 0.0
    place_s: float = 0.0
    plan_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    grammar_mask_s: float = 0.0
    grammar_advance_s: float = 0.0
    callback_s: float = 0.0
    blocks: int = 0
    prefilled_ahead: int = 0
    steps: int = 0
    generated_tokens: int = 0
    peak_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    device_peak_bytes: int | None = None

    def snapshot(self) -> EngineStats:
        """A copy that later work does not change."""
        return replace(self, peak_bytes=dict(self.peak_bytes))

    def since(self, before: EngineStats) -> EngineStats:
        """The work between `before` (an earlier snapshot) and now: counters subtracted, peaks as now."""
        counted = [f.name for f in fields(self) if f.name not in ("peak_bytes", "device_peak_bytes")]
        return replace(self.snapshot(), **{n: getattr(self, n) - getattr(before, n) for n in counted})

    def add_block(self, *, prefill_s: float, decode_s: float, grammar_s: dict[str, float],
                  callback_s: dict[str, float], steps: int, tokens: int, peak_bytes: dict[str, int],
                  prefilled_ahead: bool = False, grammar_advance_s: float = 0.0) -> None:
        """Count one finished block: the executor's prefill and decode seconds, the parts of them spent in
        the grammar and in the caller's hook (per phase "prefill"/"decode"; `grammar_advance_s`: the
        grammar's part feeding tokens), its steps and tokens, and the executor's peak bytes per tier."""
        self.prefill_s += max(0.0, prefill_s - grammar_s.get("prefill", 0.0) - callback_s.get("prefill", 0.0))
        self.decode_s += max(0.0, decode_s - grammar_s.get("decode", 0.0) - callback_s.get("decode", 0.0))
        self.grammar_mask_s += sum(grammar_s.values())
        self.grammar_advance_s += grammar_advance_s
        self.callback_s += sum(callback_s.values())
        self.blocks += 1
        self.prefilled_ahead += int(prefilled_ahead)
        self.steps += steps
        self.generated_tokens += tokens
        for tier in TIERS:
            self.peak_bytes[tier] = max(self.peak_bytes.get(tier, 0), int(peak_bytes.get(tier, 0)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
