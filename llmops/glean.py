"""Gleaning: refinement rounds for the rows a map got wrong or was unsure of (DocETL's gleaning).

`run_gleaned(table, spec, gleaning=Gleaning(rounds=1, min_confidence=0.8), check=...)` runs `spec` over every
row, then picks the rows to refine with the cascade's row selection (`llmops.cascade.escalates`): a row the
model answered whose output is null (unparsable, not one of the choices, cut by max_new_tokens), whose output
the caller's `check` rejects (a `validate` rule, a quote not found in its source), or whose confidence is
below `min_confidence`. A row whose prompt never produced text (a prompt too long, an engine error) is not
refined: there is no answer to improve. Each round re-prompts those rows with their latest output and why
it failed, as data (`llmops.validate.retry_spec`: "Your previous answer ... was rejected: ... Answer
again."), all rows of a round in one `map_table` call, and a row keeps the better of its answers: a valid
one (an output the check accepts) over an invalid one, then the higher confidence, the earlier on a tie.

With `reject`, a row whose kept output still fails the check after the last round gets a null output and an
error naming why (as `validate` does); without it the output is kept for the caller to judge (`llm_extract`
nulls the failing fields only). The result is a `llmops.validate.Checked`: one row per input row, in order,
with the attempt that gave each row's answer (`attempts`), `retried` rows re-prompted, `rejected` rows
nulled.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from llmops.cascade import check_min_confidence, escalates
from llmops.core import CacheDir, Job, MapSpec
from llmops.validate import FAILURE, PREVIOUS, Checked, failed_rules, retry_spec, run_map

# per row of (input rows, their outputs): why the output is not acceptable, or None when it is
Judge = Callable[[pa.Table, pa.Array], Sequence[str | None]]
MAX_ROUNDS = 5
_KEPT = ("output", "finish_reason", "error", "text", "confidence", "model", "prompt_tokens", "completion_tokens")


@dataclass(frozen=True)
class Gleaning:
    """Refinement rounds (at least 1) and the confidence a constrained answer needs to be kept without one
    (None: only invalid answers are refined)."""

    rounds: int = 1
    min_confidence: float | None = None


def as_gleaning(value: Any, *, constrained: bool) -> Gleaning | None:
    """The gleaning asked for: None, 0 or False (none); a number of rounds; a mapping {"rounds": n,
    "min_confidence": x}; a `Gleaning`. `constrained`: the output has choices, a schema or a regex (needed by
    min_confidence: free text has no confidence). ValueError naming what is wrong."""
    if value is None or value is False or value == 0:
        return None
    if isinstance(value, Gleaning):
        value = {"rounds": value.rounds, "min_confidence": value.min_confidence}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"rounds", "min_confidence"})
        if unknown:
            raise ValueError(f"gleaning: unknown key(s) {unknown}; a gleaning mapping has rounds and min_confidence")
        rounds, threshold = value.get("rounds", 1), value.get("min_confidence")
    else:
        rounds, threshold = value, None
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"gleaning rounds must be an integer from 1 to {MAX_ROUNDS}, got {rounds!r}")
    try:
        threshold = check_min_confidence(threshold, constrained=constrained)
    except ValueError as exc:
        raise ValueError(f"gleaning: {exc}") from None
    return Gleaning(rounds, threshold)


def rules_judge(rules: Sequence[str], output_name: str) -> Judge:
    """A judge from `validate` rules (`llmops.validate`): the first rule an output breaks."""
    def judge(inputs: pa.Table, outputs: pa.Array) -> list[str | None]:
        if output_name in inputs.column_names:
            inputs = inputs.drop_columns([output_name])
        failed = failed_rules(inputs.append_column(output_name, outputs), rules)
        return [None if rule is None else f"it must satisfy validate rule {rule}" for rule in failed]
    return judge


def _verdicts(judge: Judge | None, inputs: pa.Table, outputs: list[Any], typ: pa.DataType) -> list[str | None]:
    """Per row: why its output is rejected (None: accepted, or nothing to judge)."""
    if judge is None:
        return [None] * len(outputs)
    valued = [i for i, v in enumerate(outputs) if v is not None]
    out: list[str | None] = [None] * len(outputs)
    if valued:
        found = judge(inputs.take(pa.array(valued, pa.int64())), pa.array([outputs[i] for i in valued], typ))
        for i, why in zip(valued, found):
            out[i] = why
    return out


def _score(output: Any, verdict: str | None, confidence: float | None) -> tuple[bool, float]:
    """Better answers sort higher: valid first, then surer."""
    return output is not None and verdict is None, -1.0 if confidence is None else confidence


def run_gleaned(table: pa.Table, spec: MapSpec, *, gleaning: Gleaning, judge: Judge | None = None,
                reject: bool = True, cache_dir: CacheDir = None, progress: bool | None = None, engine: Any = None,
                job: Job | None = None) -> Checked:
    """Run `spec` over `table` with gleaning rounds (see module docstring). `judge(inputs, outputs)`: per
    row, why an output is rejected (None: accepted). `job`: the job every round is a call of (its engine and
    plan; a cascade's rounds, whose stages run the template they were built with, are jobs of their own)."""
    kw = {"cache_dir": cache_dir, "progress": progress, "engine": engine}
    result, summary = run_map(table, spec, **kw, job=job)
    out = Checked(result.select(list(_KEPT)))
    out.summary.add(summary)
    cols = {c: result.column(c).to_pylist() for c in _KEPT}
    typ = result.schema.field("output").type
    verdicts = _verdicts(judge, table, cols["output"], typ)
    attempts = [1] * table.num_rows          # the attempt whose answer a row keeps
    tried = [1] * table.num_rows             # the answers a row was given
    latest = {r: (cols["text"][r], _failure(cols, verdicts, r, gleaning.min_confidence))
              for r in range(table.num_rows)}       # the last answer each row gave, and what was wrong with it
    again = retry_spec(spec)
    for attempt in range(2, gleaning.rounds + 2):
        rows = _to_refine(cols, verdicts, gleaning.min_confidence)
        if not rows:
            break
        sub = table.take(pa.array(rows, pa.int64()))
        sub = sub.append_column(PREVIOUS, pa.array([latest[r][0] for r in rows], pa.string()))
        sub = sub.append_column(FAILURE, pa.array([latest[r][1] for r in rows], pa.string()))
        res, summary = run_map(sub, again, **kw, job=None if spec.cascade else job)
        out.summary.add(summary)
        out.retried += len(rows)
        new = {c: res.column(c).to_pylist() for c in _KEPT}
        new_verdicts = _verdicts(judge, table.take(pa.array(rows, pa.int64())), new["output"], typ)
        for k, r in enumerate(rows):
            tried[r] = attempt
            latest[r] = (new["text"][k] or latest[r][0], _failure(new, new_verdicts, k, gleaning.min_confidence))
            if _score(new["output"][k], new_verdicts[k], new["confidence"][k]) > \
                    _score(cols["output"][r], verdicts[r], cols["confidence"][r]):
                for c in _KEPT:
                    cols[c][r] = new[c][k]
                verdicts[r], attempts[r] = new_verdicts[k], attempt
    if reject:
        for r, why in enumerate(verdicts):
            if why is not None and cols["output"][r] is not None:
                shown = cols["text"][r]
                cols["output"][r], cols["finish_reason"][r], cols["confidence"][r] = None, "error", None
                cols["error"][r] = f"row {r}: output {shown!r} rejected after {tried[r]} attempt(s): {why}"
                out.rejected += 1
    out.table = pa.table({c: pa.array(cols[c], result.schema.field(c).type) for c in _KEPT})
    out.table = out.table.append_column("attempts", pa.array(attempts, pa.int64()))
    return out


def _to_refine(cols: dict[str, list[Any]], verdicts: list[str | None], min_confidence: float | None) -> list[int]:
    """The rows a round re-prompts: the cascade's selection (`escalates`) over the kept answers, among rows
    that produced text."""
    kept = pa.table({"output": pa.array([None if v is None else 0 for v in cols["output"]], pa.int64()),
                     "finish_reason": pa.array(cols["finish_reason"], pa.string()),
                     "confidence": pa.array(cols["confidence"], pa.float64())})
    flagged = [v is not None for v in verdicts]
    up = escalates(kept, min_confidence, flagged)
    return [r for r, u in enumerate(up) if u and cols["text"][r]]


def _failure(cols: dict[str, list[Any]], verdicts: list[str | None], r: int, min_confidence: float | None) -> str:
    """Why answer r of `cols` is not kept as it is, in words the prompt shows."""
    if verdicts[r] is not None:
        return verdicts[r]
    if cols["output"][r] is None:
        return cols["error"][r] or "it could not be used"
    score = cols["confidence"][r]
    return f"it was unsure (confidence {score if score is None else round(score, 2)} below {min_confidence})"
