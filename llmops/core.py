"""The single bridge from the operator layer to `engine`: Arrow rows in, Arrow completions out.

`map_table(table, spec)` renders one prompt per row (`spec.template` over the table's columns), skips null
rows, dedupes identical prompts, serves what the result cache already holds, hands the rest to the engine
in one `stream` call and yields Arrow record batches as the engine's blocks finish. Every other adapter
(Polars, DuckDB, pipelines, CLI, Ray) goes through here, and this is the only module importing `engine`, and
only its facade (the names `engine/__init__.py` exports): the commands that only plan or inspect (`llmops
policy`, `profile`, `models`) get plans, hardware profiles, sizes and the model list from the functions at the
end of this module.

Planning: a job's plan is the engine's (`engine.LLM.plan`), made from at most `PLAN_SAMPLE_ROWS` of the
prompts it generates, evenly spaced (`plan_job`): the run and its preview (`llmops run --dry-run`, through
`llmops.estimate`) take the same sample of the same rows, so the preview shows the plan the run uses.

Durability per row: with a result cache, each generated row is stored as it finishes, not when its block
ends: the engine reports finished rows from its decode loop (`stream(..., on_finished=...)`) to a
`result_cache.RowWriter`, which stores them in small groups at most `FLUSH_SECONDS` apart, and every
block is wholly stored before it is yielded. A killed run loses at most the rows in flight and the last
second's; its rerun serves the rest from the cache. An engine without `on_finished` is stored per block.
Runs sharing a cache claim the rows they generate (`llmops.row_claims`): a row another live run is generating
is waited for and served from the cache when it is stored, not generated twice.

A `Job` is one operator run over a table that may reach the engine in several calls (DuckDB's 2048-row
vectors, Polars morsels and groups): the engine's plan (policy) is chosen at the job's first call and
handed back to the engine on every later one, so the job plans once and the executor stays warm; its
`summary` adds up every call. Calls of one engine run one at a time (`engine_lock`).

Where a run's time went (`MapRun.time_split()`, for the run report): `load` (building the engine, when this
run is the first to need it), the engine's own split measured around its calls (`engine.LLM.stats`:
placing weights, planning, prefill, decode, grammar masks; see `engine.runtime.run_stats`), `cache` (the
result cache: opening, looking up, storing) and `other` (rendering, dedup, parsing, the progress bar);
`MapRun.clock` counts rows finished per time bucket (`llmops.row_clock`), as they finish.

Output batches (`output_schema(spec)`): `row` int64 (index into the input table), `output` (`output_type`),
`finish_reason` ("stop" | "length" | "error" | null for null rows), `error` (why the output is null; null
for good rows), `text` (the raw generated text; null when nothing was generated), `prompt_tokens`,
`completion_tokens` (int64), `confidence` (float64: how sure the model was of a constrained output,
`engine.decoding.confidence`; null for free text and for null outputs), `model` (the model that answered the
row; null for rows never sent to one). Per-row failures never stop the job:
- a null in any placeholder column -> null output, null finish_reason, null error, no generation;
- an empty or whitespace-only value -> as `MapSpec.on_empty` says (default: null output, null finish_reason,
  error "row i: column 'c' is empty"), no generation;
- a render failure (invalid UTF-8 bytes) or an engine error (prompt too long) -> null output, "error";
- a structured output (schema/choices/regex) cut by max_new_tokens -> null output, finish_reason "length",
  error "output cut by max_new_tokens=N before the JSON was complete" (the engine keeps a constrained row
  able to complete inside its budget, so this only happens when the shortest completion the engine finds
  is longer than max_new_tokens);
- a structured output that does not parse or is not one of the choices -> null output, "error" saying why.
Job-level failures raise: a template naming a missing column (TemplateError, before any work), a bad
spec (ValueError), an engine that cannot load or crashes (its exception; finished rows stay cached).

A spec with a `cascade` (`llmops.cascade`) runs as one `Job` per model: `MapRun` runs each model on the rows
the previous one left (`llmops.cascade.run_stages`), and its batches, summary and time split cover them all.
"""
from __future__ import annotations

import inspect
import json
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

import engine
from engine import LLM, Completion, HardwareProfile, Plan, Policy, SamplingParams, Workload, as_policy, check_choices
from engine import write_json_atomic, write_text_atomic  # re-exported: the operator layer's whole-file writes
from llmops import cascade as cascades
from llmops import engines
from llmops.progress import Progress
from llmops.report import failure_kind
from llmops.result_cache import CachedResult, RowWriter, open_cache, result_key
from llmops.row_claims import Claim
from llmops.row_clock import RowClock
from llmops.structured import arrow_type, decoding_schema, parse_json_output, to_json_schema
from llmops.summary import RunSummary, last_summaries, last_summary, record  # noqa: F401 (re-exported)
from llmops.templates import ON_EMPTY, RowOutcome, check_columns, check_examples, render_rows, template_fields
from llmops.truncation import truncate_prompt, truncate_prompts  # noqa: F401 (truncate_prompt: re-exported)

CacheDir = str | Path | None | Literal[False]
Check = Callable[[pa.Table, pa.Array], Sequence[bool]]
log = logging.getLogger(__name__)
JOB_MEMO_ROWS = 200_000   # generated results a job keeps in memory for its later calls
PLAN_SAMPLE_ROWS = 512    # prompts whose lengths stand for all of a job's when it plans (`plan_job`)
FAILED_EXAMPLES = 10      # failed rows a run keeps (row, why) of, for the summary (`llmops.summary.describe_failures`)


@dataclass(frozen=True)
class MapSpec:
    """What to generate per row. Hashable; `to_dict()`/`from_dict()` round-trip through JSON/YAML.

    template: `{column}` placeholders (see llmops.templates). system / examples: few-shot chat turns,
    examples being {"input": {column: value}, "output": str | dict}. At most one of schema (any spelling
    `llmops.structured.to_json_schema` accepts; stored as a JSON schema), choices, regex. engine: settings
    for `engine.LLM(model, **settings)` (policy, gpu_memory, dtype, ...), given as a dict or pairs; a fixed
    `policy` (a mapping of `Policy` fields) is held as a Policy (`engine_policy`).
    on_long_prompt: "error" (the row fails) or "truncate" (the row's data is cut to fit the context).
    on_empty: a row whose placeholder value is empty or whitespace only: "null" (null output, null
    finish_reason, error "row i: column 'c' is empty"), "error" (the same with finish_reason "error") or
    "run" (sent to the model like any row).
    cascade: models that answer in turn, each only the rows the one before was unsure of or got wrong
    (`llmops.cascade`; it replaces `model`, which becomes the first of them); given as a list, or a mapping
    {"models": [...], "min_confidence": x}. min_confidence: the confidence (in (0, 1]) a row needs to stop
    at a model (needs a cascade and a constrained output; None: only invalid rows go on).
    logprobs: each generated token's text and log-probability come back in the `logprobs` column."""

    template: str
    model: str = "smollm2-135m-instruct"
    system: str | None = None
    examples: tuple[dict, ...] = ()
    schema: dict | None = None
    choices: tuple[str, ...] | None = None
    regex: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    chat: bool | None = None
    stop: tuple[str, ...] = ()
    engine: tuple[tuple[str, Any], ...] = ()
    on_long_prompt: Literal["error", "truncate"] = "error"
    on_empty: Literal["null", "error", "run"] = "null"
    cascade: tuple[str, ...] = ()
    min_confidence: float | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        put = object.__setattr__
        constrained = self.schema is not None or self.choices is not None or self.regex is not None
        chain = cascades.as_cascade(self.cascade, self.min_confidence, constrained=constrained)
        put(self, "cascade", chain.models if chain is not None else ())
        put(self, "min_confidence", chain.min_confidence if chain is not None else None)
        if chain is not None:
            put(self, "model", chain.models[0])
        put(self, "examples", tuple(dict(e) if isinstance(e, dict) else e for e in self.examples))
        put(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))   # "END" is one stop
        if self.choices is not None:
            try:
                put(self, "choices", check_choices(self.choices))
            except ValueError as exc:
                raise ValueError(f"MapSpec.{exc}") from None
        if self.schema is not None:
            put(self, "schema", to_json_schema(self.schema))
        settings = self.engine.items() if isinstance(self.engine, dict) else self.engine
        put(self, "engine", tuple(sorted((str(k), engine_policy(v) if k == "policy" else
                                          tuple(v) if isinstance(v, list) else v) for k, v in settings)))
        if self.on_long_prompt not in ("error", "truncate"):
            raise ValueError(f"MapSpec.on_long_prompt must be 'error' or 'truncate', got {self.on_long_prompt!r}")
        if self.on_empty not in ON_EMPTY:
            raise ValueError(f"MapSpec.on_empty must be one of {', '.join(ON_EMPTY)}, got {self.on_empty!r}")
        template_fields(self.template)
        check_examples(self.template, self.examples)
        sampling_params(self)

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=str))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field (tuples as lists, engine settings as a dict)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["examples"] = [dict(e) for e in self.examples]
        out["stop"] = list(self.stop)
        out["choices"] = list(self.choices) if self.choices is not None else None
        out["cascade"] = list(self.cascade)
        out["engine"] = {k: v.to_dict() if isinstance(v, Policy) else v for k, v in self.engine}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MapSpec:
        """Inverse of to_dict; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"MapSpec: unknown field(s) {unknown}; known: {sorted(known)}")
        data = dict(data)
        for key in ("examples", "stop"):
            if key in data and data[key] is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def engine_policy(value: Any) -> str | Policy:
    """The engine setting `policy` as `LLM` takes it (`engine.policy.policy.as_policy`): "auto", or a fixed plan
    given as a Policy or a mapping of its fields (the "policy" object `llmops policy --json` prints). Anything
    else is a ValueError naming `engine.policy` and what is wrong with it."""
    try:
        return as_policy(value)
    except ValueError as exc:
        raise ValueError(f"engine.policy: {exc}") from None


def sampling_params(spec: MapSpec) -> SamplingParams:
    """The engine's SamplingParams for `spec` (raises ValueError on an invalid combination)."""
    return SamplingParams(
        max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
        seed=spec.seed, stop=spec.stop, json_schema=None if spec.schema is None else decoding_schema(spec.schema),
        choices=spec.choices, regex=spec.regex,
        chat=spec.chat, logprobs=spec.logprobs)


def output_type(spec: MapSpec) -> pa.DataType:
    """Arrow type of the `output` column: the schema's struct/type, else string (choices, regex, text)."""
    return arrow_type(spec.schema) if spec.schema is not None else pa.string()


LOGPROBS_TYPE = pa.list_(pa.struct([("token", pa.string()), ("logprob", pa.float64())]))


def output_schema(spec: MapSpec) -> pa.Schema:
    """Schema of every record batch `map_table` yields (with `spec.logprobs`, a last `logprobs` column:
    one {token, logprob} per generated token)."""
    return pa.schema([("row", pa.int64()), ("output", output_type(spec)), ("finish_reason", pa.string()),
                      ("error", pa.string()), ("text", pa.string()), ("prompt_tokens", pa.int64()),
                      ("completion_tokens", pa.int64()), ("confidence", pa.float64()), ("model", pa.string())]
                     + ([("logprobs", LOGPROBS_TYPE)] if spec.logprobs else []))


def stage_spec(spec: MapSpec, model: str) -> MapSpec:
    """`spec` for one model of its cascade: that model, no cascade."""
    return replace(spec, model=model, cascade=(), min_confidence=None)


def stage_engines(models: tuple[str, ...], engine: Any) -> dict[str, Any]:
    """The engines given for a cascade's models: None (each model's process-wide engine) or a mapping
    {model: engine} over some of `models`. One engine object is an error: each model needs its own."""
    if engine is None:
        return {}
    if not isinstance(engine, Mapping):
        raise ValueError("a cascade runs each model on its own engine: give engine as a mapping {model: engine} "
                         "or leave it unset (each model's engine is built on first use, see llmops.engines)")
    unknown = sorted(set(engine) - set(models))
    if unknown:
        raise ValueError(f"engine names model(s) {unknown} that are not in the cascade {list(models)}")
    return dict(engine)


def _make_llm(model: str, **settings: Any) -> Any:
    return LLM(model, **settings)


def get_engine(spec: MapSpec) -> Any:
    """The process-wide cached engine for spec.model and spec.engine settings."""
    return engines.get_engine(spec.model, spec.engine, _make_llm)


def engine_lock(eng: Any) -> threading.RLock:
    """The lock every map run holds while it drives `eng` (engines are not thread-safe; Polars evaluates
    expressions and DuckDB chunks on several threads)."""
    return engines.lock_for(eng)


class Job:
    """One operator run over a table, reaching the engine in one or many calls (see module docstring).

    engine: an `engine.LLM`-like object (default: the process-wide engine for `spec`, built on first use).
    `plan` is the engine's plan once the first call has run (None for engines without plans), `summary`
    the figures of every call so far (`summary.calls` of them). A prompt generated by one call is served to
    the job's later calls from memory (counted as deduped), with or without the result cache.
    A cascade's job holds one job per model (`stages`), each with its own engine, plan and memory; its
    `plan` is the first model's (every row runs there). Its `engine`, when given, is a mapping {model:
    engine}; a model it leaves out gets the process-wide engine."""

    def __init__(self, spec: MapSpec, *, engine: Any = None) -> None:
        self.spec = spec
        self.plan: Any = None
        self.summary = RunSummary(calls=0)
        given = stage_engines(spec.cascade, engine) if spec.cascade else {}
        self.stages = [Job(stage_spec(spec, model), engine=given.get(model)) for model in spec.cascade]
        self._engine = engine
        self._lock = threading.Lock()
        self._done: dict[str, CachedResult] = {}
        self._bar: Progress | None = None
        self.created = time.perf_counter()   # when the job was built (`llmops.summary.record` groups queries)

    def progress(self, rows: int, enabled: bool | None) -> Progress:
        """The job's one progress bar, its total grown by this call's `rows` (closed with the job)."""
        with self._lock:
            if self._bar is None:
                self._bar = Progress(rows, enabled=enabled)
                weakref.finalize(self, self._bar.close)
                return self._bar
        self._bar.grow(rows)
        return self._bar

    @property
    def engine(self) -> Any:
        if self._engine is None:
            self._engine = get_engine(self.spec)
        return self._engine

    def prepare(self, table: pa.Table) -> None:
        """Plan the job for `table`'s rows before its first call, when nothing is planned yet: a job whose
        rows come in morsels plans for the morsels that arrived together, and its runs can then be cut to
        the plan's blocks (`llmops.coalesce`). No-op for an engine without plans or a table of null rows.
        A cascade plans its first model here (the later ones plan for the rows that reach them)."""
        if self.stages:
            self.stages[0].prepare(table)
            self.plan = self.stages[0].plan
            return
        if self.plan is not None or not hasattr(self.engine, "plan"):
            return
        spec, names = self.spec, check_columns(self.spec.template, table.column_names)
        step = max(1, table.num_rows // PLAN_SAMPLE_ROWS)          # the plan needs lengths, not every prompt
        sample = table.take(list(range(0, table.num_rows, step))[:PLAN_SAMPLE_ROWS])
        columns = {f: sample.column(f).to_pylist() for f in names}
        prompts = [o.prompt for o in render_rows(spec.template, columns, sample.num_rows, system=spec.system,
                                                 examples=spec.examples, on_empty=spec.on_empty)
                   if o.prompt is not None]
        if prompts:
            rows = round(len(prompts) * table.num_rows / sample.num_rows)
            with engine_lock(self.engine):
                plan = plan_job(self.engine, prompts, sampling_params(spec), rows=rows)
            with self._lock:
                self.plan = self.plan or plan

    def recall(self, keys: Iterable[str]) -> dict[str, CachedResult]:
        """The results this job already generated for any of `keys` (prompt + parameter keys)."""
        with self._lock:
            return {k: self._done[k] for k in keys if k in self._done}

    def remember(self, results: Iterable[tuple[str, CachedResult]]) -> None:
        """Keep generated results for the job's later calls (the oldest go past `JOB_MEMO_ROWS`)."""
        with self._lock:
            self._done.update(results)
            while len(self._done) > JOB_MEMO_ROWS:
                del self._done[next(iter(self._done))]

    def finished(self, summary: RunSummary, plan: Any) -> RunSummary:
        """Record one call's figures and the plan it ran with; returns the job's summary so far."""
        with self._lock:
            self.summary.add(summary)
            self.plan = plan if plan is not None else self.plan
            return self.summary


def plan_job(eng: Any, prompts: list[Any], params: SamplingParams, *, rows: int | None = None,
             measure: bool = True) -> Plan | None:
    """The engine's plan for a job generating `prompts` (`rows` of them when they are a sample; default:
    their count), made from at most `PLAN_SAMPLE_ROWS` of them, evenly spaced: the rule a run and its
    preview share. `measure=False`: a preview (no trial runs; the plan says whether the run's will). The
    caller holds `engine_lock(eng)`. None for an engine without plans or no prompts."""
    if not prompts or not hasattr(eng, "plan"):
        return None
    step = max(1, len(prompts) // PLAN_SAMPLE_ROWS)
    return eng.plan(prompts[::step][:PLAN_SAMPLE_ROWS], params, rows=rows or len(prompts), measure=measure)


def explain_policy(spec: MapSpec, prompts: list[Any], rows: int | None = None) -> str:
    """Which plan a job of `rows` rows like `prompts` (a sample of them; None: just these) would run with and
    where it comes from (`plan_job`'s preview); nothing is generated and no trial runs. "" for an engine
    without plans."""
    eng = get_engine(spec)
    with engine_lock(eng):
        plan = plan_job(eng, prompts, sampling_params(spec), rows=rows, measure=False)
    return "" if plan is None else plan.explain()


def rows_by_result_key(outcomes: list[RowOutcome], spec: MapSpec, eng: Any) -> dict[str, list[int]]:
    """The rows of each distinct result-cache key (model fingerprint, prompt, parameters) among the
    outcomes that have a prompt, in first-row order: what a run generates once and serves to every row."""
    pdict = {**asdict(sampling_params(spec)), "on_long_prompt": spec.on_long_prompt}
    fingerprint = str(getattr(eng, "fingerprint", spec.model))
    rows: dict[str, list[int]] = {}
    for i, o in enumerate(outcomes):
        if o.prompt is not None:
            rows.setdefault(result_key(fingerprint, o.prompt, pdict), []).append(i)
    return rows


class MapRun:
    """One run of `spec` over `table`: an iterator of record batches (see module docstring).

    `summary` is updated as batches are yielded and final once the iterator is exhausted. Construction
    validates the template against the table's columns (TemplateError) and does nothing else. A cascade's
    run drives one run per model (`stage_runs`, `llmops.cascade.run_stages`); `check(inputs, outputs)`, one
    bool per row (True: the output fails the caller's rules), sends more rows on to the next model."""

    def __init__(self, table: pa.Table, spec: MapSpec, *, cache_dir: CacheDir = None,
                 progress: bool | None = None, engine: Any = None, job: Job | None = None,
                 prompts: list[Any] | None = None, check: Check | None = None) -> None:
        self.table, self.spec = table, spec
        self.fields = check_columns(spec.template, table.column_names)
        if prompts is not None and len(prompts) != table.num_rows:
            raise ValueError(f"map_table: {len(prompts)} prompts for a table of {table.num_rows} rows")
        self._prompts = prompts
        self._cache_dir, self._progress = cache_dir, progress
        self._own_job = job is None
        self.job = job if job is not None else Job(spec, engine=engine)
        self._shown = 0   # rows this call has moved the progress bar by
        self.failures: Counter[str] = Counter()        # rows with a null output, by `failure_kind`
        self.failed_examples: list[tuple[int, str]] = []  # (row, why) of the first failed rows
        self.failed_by_reason: Counter[str] = Counter()    # failed rows (errors, cut outputs) by `failure_kind`
        self.timeline: list[tuple[float, int, int]] = []  # (seconds, rows done, generated tokens) per batch
        self.clock = RowClock()                          # rows finished per time bucket
        self.load_s = self.cache_s = 0.0                 # building the engine; the result cache
        self.engine_stats: Any = None                    # the engine's EngineStats over this run's calls
        self.summary = RunSummary(rows=table.num_rows)
        self.schema = output_schema(spec)
        self._out_type = output_type(spec)
        self._iter: Iterator[pa.RecordBatch] | None = None
        self._check = check
        self.stage_runs: list[MapRun] = []               # a cascade's run of each model, in order
        self.records = True                              # False for a cascade's stage: its cascade records

    def __iter__(self) -> MapRun:
        return self

    def __next__(self) -> pa.RecordBatch:
        if self._iter is None:
            self._iter = self._run_cascade() if self.spec.cascade else self._run()
        return next(self._iter)

    def ordered(self) -> pa.Table:
        """Consume the run and return every row's result in row order."""
        batches = list(self)
        table = pa.Table.from_batches(batches, schema=self.schema)
        return table.sort_by("row") if table.num_rows else table

    def _run(self) -> Iterator[pa.RecordBatch]:
        start = time.perf_counter()
        spec, summary = self.spec, self.summary
        bar = Progress(self.table.num_rows, enabled=self._progress) if self._own_job \
            else self.job.progress(self.table.num_rows, self._progress)
        plan, writer, claim = None, None, None
        try:
            outcomes = self._render()
            early = [i for i, o in enumerate(outcomes) if o.prompt is None]
            summary.nulls = sum(1 for i in early if outcomes[i].finish_reason is None)
            self._empty_nulls = {i for i in early if outcomes[i].error and outcomes[i].finish_reason is None}
            rows_by_key: dict[str, list[int]] = {}
            eng = None
            if len(early) < len(outcomes):
                began = time.perf_counter()
                eng = self.job.engine
                self.load_s = time.perf_counter() - began
                params = sampling_params(spec)
                rows_by_key = rows_by_result_key(outcomes, spec, eng)
            summary.deduped = sum(len(r) - 1 for r in rows_by_key.values())
            began = time.perf_counter()
            cache = open_cache(None if self._cache_dir is None else self._cache_dir) \
                if self._cache_dir is not False and rows_by_key else None
            first = [(i, None, outcomes[i].error) for i in early]
            done_before = self.job.recall(rows_by_key)
            for key, res in done_before.items():
                first.extend((i, res, None) for i in rows_by_key[key])
                summary.deduped += len(rows_by_key[key])
            rest = [k for k in rows_by_key if k not in done_before]
            hits = cache.get_many(rest) if cache is not None and rest else {}
            self.cache_s += time.perf_counter() - began
            for key, res in hits.items():
                first.extend((i, res, None) for i in rows_by_key[key])
                summary.cache_hits += len(rows_by_key[key])
            if first:
                yield self._emit(first, start, bar)
            pending = [k for k in rest if k not in hits]
            if not pending:
                return
            writer = RowWriter(cache, about={k: (spec.model, outcomes[rows_by_key[k][0]].prompt) for k in pending}) \
                if cache is not None else None

            def generate(pending: list[str]) -> Iterator[pa.RecordBatch]:
                """Generate the rows of keys `pending`, storing and yielding them block by block."""
                nonlocal plan
                prompts = [outcomes[rows_by_key[k][0]].prompt for k in pending]
                with engine_lock(eng):     # planned as the dry run's preview plans (`plan_job`)
                    if self.job.plan is None:
                        self.job.plan = plan_job(eng, prompts, params)
                if spec.on_long_prompt == "truncate":
                    prompts = truncate_prompts(prompts, eng, spec.max_new_tokens, params)
                live = [0]   # tokens of rows reported finished in this call, for the bar's tok/s
                bar.expect(len(pending), spec.max_new_tokens, getattr(self.job.plan, "predicted_tokens_per_s", None))
                steps = [0, 0]   # decode steps and tokens of this call, for the debug log

                def report(idx: int, c: Completion) -> None:
                    """One row finished in the engine's decode loop: store it, move the bar by its rows."""
                    if writer is not None:
                        began = time.perf_counter()
                        writer.add(pending[idx], _to_cached(c, eng))
                        self.cache_s += time.perf_counter() - began
                    rows = len(rows_by_key[pending[idx]])
                    live[0] += len(c.token_ids)
                    self._shown += rows
                    elapsed = time.perf_counter() - start
                    self.clock.add(elapsed, rows)
                    tokens = max(summary.generated_tokens, live[0])
                    bar.advance(rows, tokens=len(c.token_ids), tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0)

                def step(tokens: int) -> None:
                    """One decode step of the engine: move the display; a debug line per step."""
                    steps[0] += 1
                    steps[1] += tokens
                    bar.step(tokens)
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("step %d: %d tokens (%d this call, %.1f s)", steps[0], tokens, steps[1],
                                  time.perf_counter() - start)
                try:
                    with engine_lock(eng):
                        stats = getattr(eng, "stats", None)
                        before = stats.snapshot() if stats is not None else None
                        if self.job.plan is not None and log.isEnabledFor(logging.INFO):
                            log.info("%d rows to generate (%d more served from the cache or deduped) with %s",
                                     len(pending), self.table.num_rows - len(pending), _plan_text(self.job.plan))
                        block_began = time.perf_counter()
                        for group in _stream(eng, prompts, params, self.job.plan, report, step):
                            plan = getattr(eng, "last_plan", None)
                            log.info("block of %d rows done in %.1f s (%d tokens)", len(group),
                                     time.perf_counter() - block_began, sum(len(c.token_ids) for _, c in group))
                            block_began = time.perf_counter()
                            done = [(pending[idx], _to_cached(c, eng), c.error) for idx, c in group]
                            summary.generated_rows += len(done)
                            summary.generated_tokens += sum(r.completion_tokens for _, r, _ in done)
                            summary.prompt_tokens += sum(r.prompt_tokens for _, r, _ in done)
                            if writer is not None:
                                began = time.perf_counter()
                                writer.finish_block((k, r) for k, r, _ in done)
                                claim.release([k for k, _, _ in done])
                                self.cache_s += time.perf_counter() - began
                            self.job.remember((k, r) for k, r, _ in done)
                            if before is not None:
                                self.engine_stats = stats.since(before)
                            yield self._emit([(i, r, err) for k, r, err in done for i in rows_by_key[k]], start, bar)
                finally:
                    bar.idle()

            # rows another run sharing the cache is generating are waited for, not generated twice
            claim = Claim(cache, pending) if cache is not None else None
            todo, theirs = (claim.mine, claim.theirs) if claim is not None else (pending, [])
            while todo or theirs:
                if todo:
                    yield from generate(todo)
                found, todo = claim.wait(theirs) if theirs else ({}, [])
                gone = set(found).union(todo)
                theirs = [k for k in theirs if k not in gone]
                if found:
                    summary.cache_hits += sum(len(rows_by_key[k]) for k in found)
                    yield self._emit([(i, res, None) for k, res in found.items() for i in rows_by_key[k]], start, bar)
        finally:
            if writer is not None:
                began = time.perf_counter()
                _close_quietly(writer)
                self.cache_s += time.perf_counter() - began
            if claim is not None:
                _close_quietly(claim)
            if self._own_job:
                bar.close()
            summary.seconds = time.perf_counter() - start
            if summary.rows_by_model:
                summary.seconds_by_model = {spec.model: summary.seconds}
            total = self.job.finished(summary, plan)
            if self.records:
                record(total, job=self.job, created=self.job.created, began=start)

    def _run_cascade(self) -> Iterator[pa.RecordBatch]:
        """Each model of the cascade on the rows the one before left (`llmops.cascade`), one run of the
        model's job each; batches carry the original rows."""
        start = time.perf_counter()
        spec, summary = self.spec, self.summary
        summary.rows_by_model = dict.fromkeys(spec.cascade, 0)

        def stage(k: int, rows: list[int]) -> Iterator[pa.RecordBatch]:
            whole = k == 0
            job = self.job.stages[k]
            prompts = None if self._prompts is None else [self._prompts[i] for i in rows]
            run = MapRun(self.table if whole else self.table.take(rows), job.spec, cache_dir=self._cache_dir,
                         progress=self._progress, job=job, prompts=prompts)
            run.records = False
            self.stage_runs.append(run)
            summary.escalated += 0 if whole else len(rows)
            ids = pa.array(rows, pa.int64())
            for batch in run:
                yield batch if whole else batch.set_column(0, "row", ids.take(batch.column("row")))

        def escalate(batch: pa.RecordBatch) -> list[bool]:
            flagged = None if self._check is None else self._check(self.table.take(batch.column("row")),
                                                                   batch.column("output"))
            return cascades.escalates(batch, spec.min_confidence, flagged)

        try:
            for _, batch in cascades.run_stages(len(spec.cascade), range(self.table.num_rows), stage, escalate):
                self._count(batch)
                summary.seconds = time.perf_counter() - start
                self.timeline.append((round(summary.seconds, 3), summary.done_rows, summary.generated_tokens))
                self.clock.add(summary.seconds, batch.num_rows)
                yield batch
        finally:
            for run in self.stage_runs:
                done = run.summary
                for name in ("generated_rows", "generated_tokens", "prompt_tokens", "cache_hits", "deduped", "nulls"):
                    setattr(summary, name, getattr(summary, name) + getattr(done, name))
                summary.seconds_by_model = {m: summary.seconds_by_model.get(m, 0.0) + done.seconds_by_model.get(m, 0.0)
                                            for m in {**summary.seconds_by_model, **done.seconds_by_model}}
            self.engine_stats = self.stage_runs[0].engine_stats if self.stage_runs else None
            summary.seconds = time.perf_counter() - start
            record(self.job.finished(summary, self.job.stages[0].plan), job=self.job, created=self.job.created,
                   began=start)

    _empty_nulls: set[int] = set()  # rows with empty values under on_empty="null": error text, no reason

    def time_split(self) -> dict[str, float]:
        """Seconds of this run by where they went (see module docstring); they sum to `summary.seconds`
        (`other` takes the rest). Engine figures are 0 for an engine without `stats`. A cascade's parts are
        its models' runs' parts summed (`engine_stats` is the first model's)."""
        eng = None if self.stage_runs else self.engine_stats
        split = {"load": self.load_s, "place_weights": 0.0, "plan": 0.0, "prefill": 0.0, "decode": 0.0,
                 "grammar_mask": 0.0, "cache": self.cache_s}
        for run in self.stage_runs:
            for part, seconds in run.time_split().items():
                if part != "other":
                    split[part] += seconds
        if eng is not None:
            split.update(place_weights=eng.place_s, plan=eng.plan_s, prefill=eng.prefill_s, decode=eng.decode_s,
                         grammar_mask=eng.grammar_mask_s)
        split["other"] = max(0.0, self.summary.seconds - sum(split.values()))
        return split

    def _render(self) -> list[RowOutcome]:
        spec = self.spec
        if self._prompts is not None:
            return [RowOutcome(p) for p in self._prompts]
        columns = {f: self.table.column(f).to_pylist() for f in self.fields}
        return render_rows(spec.template, columns, self.table.num_rows, system=spec.system,
                           examples=spec.examples, on_empty=spec.on_empty)

    def _emit(self, items: list[tuple[int, CachedResult | None, str | None]], start: float,
              bar: Progress) -> pa.RecordBatch:
        cols: dict[str, list[Any]] = {n: [] for n in self.schema.names}
        for row, res, err in items:
            value, reason, err = self._decode(res, err) if row not in self._empty_nulls else (None, None, err)
            cols["row"].append(row)
            cols["output"].append(value)
            cols["finish_reason"].append(reason)
            cols["error"].append(err)
            cols["text"].append(res.text if res is not None and res.finish_reason != "error" else None)
            cols["prompt_tokens"].append(res.prompt_tokens if res is not None else 0)
            cols["completion_tokens"].append(res.completion_tokens if res is not None else 0)
            cols["confidence"].append(res.confidence if res is not None and value is not None else None)
            cols["model"].append(self.spec.model if res is not None else None)
            if "logprobs" in cols:
                cols["logprobs"].append(None if res is None or res.logprobs is None else
                                        [{"token": t, "logprob": lp} for t, lp in res.logprobs])
        batch = pa.RecordBatch.from_pydict(cols, schema=self.schema)
        self._count(batch)
        s = self.summary
        s.seconds = time.perf_counter() - start
        self.timeline.append((round(s.seconds, 3), s.done_rows, s.generated_tokens))
        step, self._shown = max(0, s.done_rows - self._shown), max(self._shown, s.done_rows)
        self.clock.add(s.seconds, step)
        bar.update(step, tokens_per_s=s.tokens_per_s, cache_hits=s.cache_hits, errors=s.errors)
        return batch

    def _count(self, batch: pa.RecordBatch) -> None:
        """Add a batch of finished rows to the figures: errors, cut rows, failures by kind, rows per model,
        the confidence histogram."""
        s = self.summary
        columns = (batch.column("output").is_null().to_pylist(), batch.column("finish_reason").to_pylist(),
                   batch.column("error").to_pylist(), batch.column("model").to_pylist(),
                   batch.column("row").to_pylist())
        for missing, reason, err, model, row in zip(*columns):
            s.errors += reason == "error"
            s.truncated += reason == "length" and missing
            if reason == "error" or (reason == "length" and missing):
                self.failed_by_reason[failure_kind(reason, err) or "engine error"] += 1
                if len(self.failed_examples) < FAILED_EXAMPLES:
                    self.failed_examples.append((row, err or f"finish_reason {reason}"))
            kind = failure_kind(reason, err) if missing else None
            if kind is not None:
                self.failures[kind] += 1
            if model is not None:
                s.rows_by_model[model] = s.rows_by_model.get(model, 0) + 1
        bins = cascades.confidence_bins(batch.column("confidence").to_pylist())
        if any(bins):
            s.confidence_bins = [a + b for a, b in zip(s.confidence_bins or [0] * len(bins), bins)]
        s.done_rows += batch.num_rows

    def _decode(self, res: CachedResult | None, err: str | None) -> tuple[Any, str | None, str | None]:
        """(output value, finish_reason, error) of one row from its completion."""
        if res is None:
            return None, ("error" if err is not None else None), err
        if res.finish_reason == "error":
            return None, "error", err or "engine error"
        spec = self.spec
        structured = spec.schema is not None or spec.choices is not None or spec.regex is not None
        if structured and res.finish_reason != "stop":
            what = "JSON" if spec.schema is not None else "choice" if spec.choices is not None else "regex match"
            return None, res.finish_reason, (f"output cut by max_new_tokens={spec.max_new_tokens} before the "
                                             f"{what} was complete")
        if spec.schema is not None:
            try:
                return parse_json_output(res.text, spec.schema, self._out_type), res.finish_reason, None
            except ValueError as exc:
                return None, "error", f"unparsable structured output: {exc}"
        if spec.choices is not None and res.text not in spec.choices:
            return None, "error", f"output {res.text[:80]!r} is not one of the choices"
        return res.text, res.finish_reason, None


def _to_cached(c: Completion, eng: Any = None) -> CachedResult:
    """The stored form of a completion; its logprobs (when the engine reported them) as (token text, logprob)
    pairs, each token decoded alone by the engine's tokenizer."""
    logprobs = None
    if c.logprobs is not None and c.finish_reason != "error":
        tok = getattr(eng, "tokenizer", None)
        texts = [tok.decode([t], skip_special_tokens=False) if tok is not None else str(t) for t in c.token_ids]
        logprobs = tuple(zip(texts, (float(x) for x in c.logprobs)))
    return CachedResult(c.text, c.finish_reason, int(c.prompt_tokens), len(c.token_ids), c.confidence, logprobs)


def _stream(eng: Any, prompts: list[Any], params: SamplingParams, plan: Any, on_finished: Any = None,
            on_step: Any = None) -> Iterator[list[tuple[int, Completion]]]:
    """The engine's groups; `on_finished(index, completion)` goes to an engine whose `stream` takes it
    (`engine.LLM`: rows reported as they finish, for `RowWriter`), else rows are stored per group;
    `on_step(tokens)` (each decode step, for the progress display) likewise."""
    if not hasattr(eng, "stream"):
        yield list(enumerate(eng.generate(prompts, params)))
        return
    kwargs: dict[str, Any] = {"plan": plan} if hasattr(eng, "plan") else {}
    for name, hook in (("on_finished", on_finished), ("on_step", on_step)):
        if hook is not None and _takes(eng.stream, name):
            kwargs[name] = hook
    yield from eng.stream(prompts, params, **kwargs)


def _plan_text(plan: Any) -> str:
    """A plan as the log shows it: `Plan.explain()` (placement, predicted speed) or its repr."""
    explain = getattr(plan, "explain", None)
    return ("the plan:\n" + explain()) if callable(explain) else repr(plan)


def _takes(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _close_quietly(owner: RowWriter | Claim) -> None:
    """Store what a writer holds, or free a run's row claims; a failure is logged (the run's own outcome, or
    exception, stands; claims of a gone run go stale and are taken over)."""
    try:
        owner.close()
    except Exception as exc:  # noqa: BLE001
        log.warning("result cache %s: could not close %s: %s", owner.cache.path, type(owner).__name__, exc)


def map_table(table: pa.Table, spec: MapSpec, *, cache_dir: CacheDir = None, progress: bool | None = None,
              engine: Any = None, job: Job | None = None, prompts: list[Any] | None = None,
              check: Check | None = None) -> MapRun:
    """Run `spec` over every row of `table`; an iterator of record batches as blocks finish (rows already
    cached, null and unrenderable rows come first; not in row order). cache_dir: None = the default
    result cache dir, False = no cache. progress: None = a bar when stderr is a TTY. engine: an object
    with the `engine.LLM` API (default: the process-wide cached LLM for spec.model/spec.engine).
    job: the `Job` this run is one call of (its engine and plan are used; default: a job of its own).
    prompts: one engine prompt per row, already built (marked parts or chat messages, see llmops.templates;
    None: a null row), used instead of rendering `spec.template` (`llmops batch`: OpenAI request files).
    check: for a cascade, `check(inputs, outputs)` flags rows whose output fails the caller's rules, so they
    run on the next model too (`llmops.cascade`).
    The returned MapRun's `.summary` holds this call's figures (final once exhausted), `.job.summary` the
    job's; `last_summary()` returns the job's, or its query's (`llmops.summary.last_summary`)."""
    return MapRun(table, spec, cache_dir=cache_dir, progress=progress, engine=engine, job=job, prompts=prompts,
                  check=check)


def map_table_ordered(table: pa.Table, spec: MapSpec, **kwargs: Any) -> pa.Table:
    """All of `map_table`'s rows as one table in row order (same columns; kwargs as map_table)."""
    return map_table(table, spec, **kwargs).ordered()


def embed_texts(texts: Sequence[str | None], *, model: str = "smollm2-135m-instruct",
                engine_settings: Mapping[str, Any] | None = None,
                engine: Any = None) -> tuple[list[list[float] | None], list[str | None]]:
    """(embedding, error) per text, in order: one `engine.LLM.embed` call over the distinct non-null texts
    (unit-length vectors, see `engine.runtime.embed`), on `engine` or the process-wide engine of `model` and
    `engine_settings` (shared with the maps of that model). A null text gives (None, None); a text that cannot
    run gives (None, why). Embeddings are not stored in the result cache."""
    eng = engine if engine is not None else get_engine(MapSpec(template="{text}", model=model,
                                                               engine=tuple((engine_settings or {}).items())))
    distinct = list(dict.fromkeys(t for t in texts if t is not None))
    with engine_lock(eng):
        done = dict(zip(distinct, eng.embed(distinct))) if distinct else {}
    vectors = [None if t is None else done[t].vector for t in texts]
    errors = [None if t is None else done[t].error for t in texts]
    return vectors, errors


# ---- planning, machines, models and sizes, for the commands that only plan or inspect (`llmops policy`,
# `llmops profile`, `llmops models`), through the engine's facade

NoFeasiblePolicy = engine.NoFeasiblePolicy    # what `plan_model` raises when no policy fits the budgets
DEFAULT_CPU_SHARE = engine.PINNED_SHARE       # of the host's available RAM: the cpu tier's default budget
REFERENCE_MACHINES = ("h200",)                # built-in hardware profiles (`engine.reference_profile`)


def parse_size(value: str | int) -> int:
    """Bytes from "16GiB", "500GB", "4096" (`engine.parse_size`); ValueError naming the input."""
    return engine.parse_size(value)


def format_size(n: float) -> str:
    """Bytes for people, e.g. "16.00 GiB"."""
    return engine.format_size(n)


def engine_models() -> list[dict[str, Any]]:
    """The engine's aliases and presets (`engine.list_models`)."""
    return list(engine.list_models())


def default_device() -> str:
    """The device a run uses here: "cuda" with a GPU, else "cpu"."""
    return engine.default_device()


def hardware_profile(source: str | Path = "local") -> tuple[HardwareProfile, str]:
    """(profile, description) to plan with: "local" (the profile a run on this machine plans with: on a GPU
    measured once and cached, on a CPU the cached or default one), a built-in machine (`REFERENCE_MACHINES`)
    or a profile JSON file (a Path). ValueError naming the file or the name otherwise."""
    if isinstance(source, Path):
        profile = engine.load_profile(source)
        return profile, f"file {source} ({profile.device_name})"
    if source == "local":
        profile = engine.planning_profile(default_device())
        return profile, f"this machine ({profile.device_name}, {profile.source})"
    if source not in REFERENCE_MACHINES:
        raise ValueError(f"hardware {source!r}: expected 'local', one of {list(REFERENCE_MACHINES)} or a file")
    profile = engine.reference_profile(source)
    return profile, f"built-in reference {source} ({profile.device_name})"


def measure_profile(device: str, *, refresh: bool = False,
                    disk_dir: Path | None = None) -> tuple[HardwareProfile, Path]:
    """This machine's profile of `device` ("cuda" or "cpu"), measured (under a minute) unless cached
    (`refresh`: measured again), and its cache file."""
    kwargs = {"disk_dir": disk_dir} if disk_dir is not None else {}
    return engine.load_or_measure(device, refresh=refresh, **kwargs), engine.profile_cache_path(device)


def plan_model(model: str, *, prompt_len: int, gen_len: int, num_prompts: int | None = None,
               max_prompt_len: int | None = None, shared_prefix_len: int = 0, profile: HardwareProfile,
               **settings: Any) -> Plan:
    """The plan `llmops run` would run a job of this shape with (`engine.plan_model`: the engine's planning
    path and defaults, no weights loaded, no trial run). `settings`: `engine.LLM`'s (`gpu_memory`,
    `cpu_memory`, `disk_memory`, `dtype`, `compress_weights`, `compress_cache`, `trials`) and `devices` (GPUs
    of one host). Raises NoFeasiblePolicy, ValueError for a bad setting or workload."""
    workload = Workload(prompt_len=prompt_len, gen_len=gen_len, num_prompts=num_prompts,
                        max_prompt_len=max_prompt_len, shared_prefix_len=shared_prefix_len)
    return engine.plan_model(model, workload, profile=profile, **settings)


def plan_budgets(profile: HardwareProfile, *, devices: int = 1, gpu_memory: int | None = None,
                 cpu_memory: int | None = None, disk_memory: int | None = None) -> engine.Budgets:
    """Each GPU's budgets for a plan under these settings on `profile`'s machine (`engine.resolve_budgets`,
    the rule every planning path follows)."""
    return engine.resolve_budgets(profile, engine.PlanSettings(gpu_memory=gpu_memory, cpu_memory=cpu_memory,
                                                               disk_memory=disk_memory, num_devices=devices))
