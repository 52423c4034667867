"""Cascades: every row runs on the first model; only the unsure or invalid rows run again on the next.

A cascade is an ordered list of at least two models and an optional `min_confidence` in (0, 1]. Every
operator takes it as `cascade=[small, large]` with `min_confidence=0.9` (Polars `llm_map`, DuckDB `register` and
`map_relation`, the pipeline's `llm_map` step), or as one mapping `cascade={"models": [small, large],
"min_confidence": 0.9}` (the spelling the semantic operators take, as `llm_join`'s own `min_confidence` is its
pair threshold). The cascade replaces `model`.

Which rows go on (`escalates`): a row the model answered (finish_reason not null) runs again on the next model
when
- its output is null: an engine error (a prompt too long for the model...), a structured output cut by
  max_new_tokens, an unparsable output, an answer that is not one of the choices;
- the caller's check flags it (an `llm_map`'s `validate` rules: `llmops.validate`);
- `min_confidence` is set and the row's confidence (`engine.decoding.confidence`) is below it, or unknown (an
  engine that reports none, or a result cached before results carried one).
Rows never sent to a model (null or empty inputs, unrenderable rows) keep the first model's null answer. The
last model's answer is final, whatever it is. `min_confidence` needs a constrained output (choices, schema or
regex): free text carries no confidence. Without it, only invalid rows go on.

How it runs (`llmops.core.MapRun` through `run_stages`): one `llmops.core.Job` per model, each planned once from
the rows it gets, each through the result cache (whose key holds the model's fingerprint, so a rerun serves
every model's rows from the cache). The first model's confident rows stream out as its blocks finish; the rows
it leaves run on the next model as one call once it is done. Each output row says which model answered it
(`model`) and how sure it was (`confidence`). Pure Python over Arrow: no engine, no core.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

BINS = 10   # confidence histogram: bin i holds [i/10, (i+1)/10), the last one also 1.0


@dataclass(frozen=True)
class Cascade:
    """Models in the order rows try them, and the confidence a row needs to stop (None: only invalid rows
    go on)."""

    models: tuple[str, ...]
    min_confidence: float | None = None


def as_cascade(cascade: Any, min_confidence: Any = None, *, constrained: bool) -> Cascade | None:
    """The cascade asked for by `cascade` (None or empty: none; a list of model names; a mapping
    {"models": [...], "min_confidence": x}; a `Cascade`) and a separate `min_confidence`. `constrained`: the
    output has choices, a schema or a regex. Raises ValueError naming what is wrong."""
    if isinstance(cascade, Cascade):
        cascade = {"models": cascade.models, "min_confidence": cascade.min_confidence}
    if isinstance(cascade, Mapping):
        unknown = sorted(set(cascade) - {"models", "min_confidence"})
        if unknown:
            raise ValueError(f"cascade: unknown key(s) {unknown}; a cascade mapping has models and min_confidence")
        inner = cascade.get("min_confidence")
        if inner is not None and min_confidence is not None and inner != min_confidence:
            raise ValueError(f"cascade: min_confidence is given twice ({inner} and {min_confidence})")
        min_confidence = inner if inner is not None else min_confidence
        cascade = cascade.get("models")
    if cascade is None or (isinstance(cascade, (list, tuple)) and not cascade):
        if min_confidence is not None:
            raise ValueError("min_confidence is a cascade's threshold: give cascade=[first_model, next_model, ...] too")
        return None
    if isinstance(cascade, str) or not isinstance(cascade, (list, tuple)):
        raise ValueError(f"cascade must be a list of at least two model names, got {cascade!r}")
    models = tuple(cascade)
    for i, model in enumerate(models):
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"cascade[{i}] must be a model name, got {model!r}")
    if len(models) < 2:
        raise ValueError(f"cascade needs at least two models, got {list(models)}")
    twice = sorted({m for m in models if models.count(m) > 1})
    if twice:
        raise ValueError(f"cascade names model(s) {twice} more than once")
    return Cascade(models, check_min_confidence(min_confidence, constrained=constrained))


def check_step_cascade(value: Any, model: Any, *, constrained: bool) -> Any:
    """A pipeline step's `cascade` option, given beside its `model` option: `value` unchanged when it is a valid
    cascade (`as_cascade`) and `model` is not also given; ValueError saying which otherwise."""
    if value is not None:
        if model is not None:
            raise ValueError("give model or cascade, not both (the cascade's first model answers first)")
        as_cascade(value, constrained=constrained)
    return value


def check_min_confidence(value: Any, *, constrained: bool) -> float | None:
    """`value` as a float in (0, 1] (None stays None); ValueError otherwise, or when the output is free text."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"min_confidence must be a number in (0, 1], got {value!r}")
    if not constrained:
        raise ValueError("min_confidence needs a constrained output (choices, schema or regex): free text carries "
                         "no confidence")
    return float(value)


def escalates(batch: pa.RecordBatch | pa.Table, min_confidence: float | None,
              flagged: Sequence[bool] | None = None) -> list[bool]:
    """Per row of a map's output batch (`llmops.core.output_schema`): whether it runs again on the next
    model (see module docstring). `flagged`: per row, the caller's check failed."""
    reasons = batch.column("finish_reason").to_pylist()
    outputs = batch.column("output").is_null().to_pylist()
    scores = batch.column("confidence").to_pylist()
    out = []
    for i, (reason, missing, score) in enumerate(zip(reasons, outputs, scores)):
        if reason is None:
            out.append(False)
        elif missing or (flagged is not None and flagged[i]):
            out.append(True)
        else:
            out.append(min_confidence is not None and (score is None or score < min_confidence))
    return out


StageRunner = Callable[[int, list[int]], Iterable[pa.RecordBatch]]
Escalate = Callable[[pa.RecordBatch], list[bool]]


def run_stages(stages: int, rows: Sequence[int], run_stage: StageRunner,
               escalate: Escalate) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Run a cascade of `stages` models over `rows`: `run_stage(k, rows)` runs model k on those rows and
    yields output batches whose `row` column names them; `escalate(batch)` says which of a batch's rows go
    on. Yields (k, batch) for the rows model k answers for good, as its batches come: every row once."""
    pending = list(rows)
    for k in range(stages):
        last = k == stages - 1
        held: list[int] = []
        for batch in run_stage(k, pending):
            up = [False] * batch.num_rows if last else escalate(batch)
            if any(up):
                ids = batch.column("row").to_pylist()
                held += [r for r, u in zip(ids, up) if u]
                batch = batch.filter(pa.array([not u for u in up]))
            if batch.num_rows:
                yield k, batch
        if not held:
            return
        pending = sorted(held)


def confidence_bins(values: Iterable[float | None]) -> list[int]:
    """A histogram of the confidences that are not None: `BINS` counts over [0, 1] (see BINS)."""
    counts = [0] * BINS
    for v in values:
        if v is not None:
            counts[min(BINS - 1, max(0, int(v * BINS)))] += 1
    return counts
