"""The pipeline schema: pydantic models for `source -> steps -> sink` (every model `extra="forbid"`).

A pipeline is data. `Pipeline.from_dict(p.to_dict()) == p` for every valid pipeline; `to_dict()` omits
defaults so it reads like what a person would write. Paths (source/sink files, databases, cache and disk
dirs) expand `${VAR}` and `${VAR:-default}` from the environment when validated; an unset variable without
a default is an error naming the variable. Relative paths are relative to the YAML file's folder when
loaded from a file (`llmops.pipeline.load.rebase_paths`), else to the working directory.

YAML shape (see `pipelines/*.yaml`):

    model: smollm2-135m-instruct         # alias, preset, HF folder or .gguf path; steps may override
    engine: {policy: auto, gpu_memory: 16GiB, device: auto}
    cache_dir: out/cache                  # result cache (resume); false disables; null: $LLMOPS_CACHE_DIR
    source: {csv: sample_data/invoices.csv}
    steps:
      - sql: SELECT * FROM input WHERE body IS NOT NULL     # DuckDB; the current table is `input`
      - llm_map: {output: fields, template: "...{body}", schema: {total: number}, unnest: true}
      - filter: total > 0                                     # a DuckDB boolean expression
      - dedupe: [invoice_number]                             # keep the first row per key (all columns: [])
      - parse: {total: double, due: date}                    # TRY_CAST: unparsable -> null
      - select: [id, invoice_number, total]                  # or {new_name: SQL expression}
    sink: {parquet: out/invoices.parquet}

Everything that can be checked without a model is checked here, so a bad file fails before any work with
`file:line`: numbers are numbers (`max_new_tokens: true` is an error, not 1), a regex and a JSON schema
compile to a grammar (llguidance's grammar validation, no tokenizer needed).
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      ValidationInfo, field_validator, model_validator)

from llmops.cascade import as_cascade, check_step_cascade
from llmops.core import check_choices, engine_policy, parse_size
from llmops.glean import as_gleaning
from llmops.pipeline.operator_spec import OPERATOR_STEP_KINDS
from llmops.pipeline.semantic_spec import SEMANTIC_STEP_KINDS, Rules
from llmops.structured import arrow_type, decoding_schema, to_json_schema
from llmops.templates import template_fields

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: str) -> str:
    """Replace `${VAR}` / `${VAR:-default}` with the environment's value; unset and no default: error."""
    def sub(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise ValueError(f"environment variable {name} is not set (used in {value!r}; "
                         f"write ${{{name}:-default}} for a fallback)")
    return _ENV.sub(sub, value)


PathStr = Annotated[str, AfterValidator(expand_env)]


def _not_bool(value: Any) -> Any:
    """YAML's true/false are not numbers (pydantic would read `true` as 1)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
def _finite(value: Any) -> Any:
    """A number that is not a boolean, NaN or infinite (YAML's .nan and .inf are no usable numbers)."""
    value = _not_bool(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value}")
    return value


Float = Annotated[float, BeforeValidator(_finite)]


def _grammar_problem(grammar: Any) -> str | None:
    """llguidance's complaint about a grammar (its `error: ...` line), or None when it is valid."""
    from llguidance import LLMatcher  # optional at import time: only grammar checks need llguidance

    message = LLMatcher.validate_grammar(grammar, None)
    if not message:
        return None
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return next((line.removeprefix("error: ") for line in lines if line.startswith("error: ")), lines[0])


def check_regex(regex: str | None) -> str | None:
    """A regex constrained decoding can compile (Rust regex syntax: no look-around, no backreferences)."""
    if regex is None:
        return None
    if not regex:
        raise ValueError("regex must not be empty")
    from llguidance import LLMatcher  # optional at import time: only grammar checks need llguidance

    problem = _grammar_problem(LLMatcher.grammar_from_regex(regex))
    if problem:
        raise ValueError(f"invalid regex {regex!r}: {problem}")
    return regex


def check_json_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A JSON schema that `llmops.structured` and constrained decoding accept (returned as given)."""
    if schema is None:
        return None
    try:
        normal = to_json_schema(schema)
        arrow_type(normal)               # a $ref that points at nothing fails here, with its name
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid JSON schema: {exc}") from None
    from llguidance import LLMatcher  # optional at import time: only grammar checks need llguidance

    try:
        problem = _grammar_problem(LLMatcher.grammar_from_json_schema(json.dumps(decoding_schema(normal))))
    except (TypeError, ValueError) as exc:
        problem = str(exc)
    if problem:
        raise ValueError(f"invalid JSON schema: {problem}")
    return schema

TYPE_ALIASES: dict[str, str] = {
    "string": "VARCHAR", "str": "VARCHAR", "text": "VARCHAR", "varchar": "VARCHAR",
    "int": "BIGINT", "integer": "BIGINT", "bigint": "BIGINT",
    "float": "DOUBLE", "double": "DOUBLE", "number": "DOUBLE",
    "bool": "BOOLEAN", "boolean": "BOOLEAN",
    "date": "DATE", "timestamp": "TIMESTAMP", "datetime": "TIMESTAMP",
}
_DECIMAL = re.compile(r"^decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)$", re.IGNORECASE)


def duckdb_type(name: str) -> str:
    """The DuckDB type for a `parse` type name (see TYPE_ALIASES, or decimal(p,s)); else ValueError."""
    key = name.strip().lower()
    if key in TYPE_ALIASES:
        return TYPE_ALIASES[key]
    match = _DECIMAL.match(key)
    if match:
        return f"DECIMAL({match.group(1)},{match.group(2)})"
    raise ValueError(f"unknown type {name!r}; expected one of {', '.join(sorted(TYPE_ALIASES))} or decimal(p,s)")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _exactly_one(model: BaseModel, names: tuple[str, ...], what: str) -> str:
    given = [n for n in names if getattr(model, n) is not None]
    if len(given) != 1:
        raise ValueError(f"{what} needs exactly one of {', '.join(names)}; got "
                         f"{', '.join(given) if given else 'none'}")
    return given[0]


class Source(_Strict):
    """Where rows come from: one file (csv, parquet, jsonl), a DuckDB `query` (optionally over a
    `database` file), or a `table` of a `database` file. `limit` caps the rows read."""

    csv: PathStr | None = None
    parquet: PathStr | None = None
    jsonl: PathStr | None = None
    query: str | None = None
    table: str | None = None
    database: PathStr | None = None
    limit: Int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_kind(self) -> "Source":
        kind = _exactly_one(self, ("csv", "parquet", "jsonl", "query", "table"), "source")
        if kind == "table" and self.database is None:
            raise ValueError("source.table needs source.database (a DuckDB file)")
        if self.database is not None and kind not in ("query", "table"):
            raise ValueError(f"source.database goes with query or table, not {kind}")
        return self

    @property
    def kind(self) -> str:
        return next(n for n in ("csv", "parquet", "jsonl", "query", "table") if getattr(self, n) is not None)


class Sink(_Strict):
    """Where results go: a parquet/csv/jsonl file or a DuckDB `table` in a `database` file. Files are
    written under a temporary name and renamed when the run completes; a DuckDB table is replaced
    (`mode: replace`) or appended to (`mode: append`) in one transaction at the end."""

    parquet: PathStr | None = None
    csv: PathStr | None = None
    jsonl: PathStr | None = None
    database: PathStr | None = None
    table: str | None = None
    mode: Literal["replace", "append"] = "replace"

    @model_validator(mode="after")
    def _one_kind(self) -> "Sink":
        kind = _exactly_one(self, ("parquet", "csv", "jsonl", "database"), "sink")
        if kind == "database" and not self.table:
            raise ValueError("sink.database needs sink.table (the DuckDB table to write)")
        if kind != "database" and self.table is not None:
            raise ValueError("sink.table goes with sink.database")
        if kind != "database" and self.mode != "replace":
            raise ValueError("sink.mode 'append' is only for a DuckDB table; files are always replaced")
        return self

    @property
    def kind(self) -> str:
        return next(n for n in ("parquet", "csv", "jsonl", "database") if getattr(self, n) is not None)

    @property
    def target(self) -> str:
        """A human name for where the rows end up."""
        return f"{self.database}:{self.table}" if self.kind == "database" else str(getattr(self, self.kind))


def _policy_setting(value: str | dict[str, Any]) -> str | dict[str, Any]:
    """`engine.policy`: "auto", or a fixed plan as a mapping of Policy fields, checked here (unknown or invalid
    fields are an error naming them) and kept as the mapping."""
    if isinstance(value, dict):
        engine_policy(value)
    return value


DTYPES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _size(value: Any) -> Any:
    """A budget: bytes or a string like "16GiB" (checked here, kept as given); None: no budget."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a size in bytes or a string like '16GiB', got {value!r}")
    parse_size(value)
    return value


def _dtype(value: str) -> str:
    if value not in DTYPES:
        raise ValueError(f"unknown dtype {value!r}; expected one of {', '.join(DTYPES)}")
    return value


def _device(value: str) -> str:
    if not _DEVICE.match(value):
        raise ValueError(f"unknown device {value!r}; expected auto, cpu, cuda or cuda:N")
    return value


def _devices(value: Any) -> Any:
    """None, "auto", or a list of CUDA indices (>= 0) / device strings ("cuda:1")."""
    if value is None or value == "auto":
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected auto or a non-empty list of CUDA indices / device strings, got {value!r}")
    for i, d in enumerate(value):
        if isinstance(d, bool) or not (isinstance(d, int) and d >= 0 or isinstance(d, str) and _DEVICE.match(d)):
            raise ValueError(f"devices[{i}]: expected a CUDA index (0, 1, ...) or a device string like 'cuda:1', "
                             f"got {d!r}")
    return value


Size = Annotated[int | str | None, BeforeValidator(_size)]


class EngineSettings(_Strict):
    """Arguments of `engine.LLM(...)`. Sizes are bytes or strings like "16GiB"; None: no budget. `policy`:
    "auto" (the engine plans the job) or a fixed plan, a mapping of Policy fields (what `llmops policy --json`
    prints under "policy"; fields left out take Policy's defaults). `devices`:
    "auto" (every visible GPU) or a list of CUDA indices / device strings, `parallel` how blocks use them
    ("auto": data-parallel when the model's weights fit each GPU's budget, else pipeline stages). `trials`:
    on a GPU, the job's first run of a plan the cost model chose measures its best `trials` candidates and
    keeps the fastest in the plan cache (0: the cost model decides alone)."""

    policy: Annotated[Literal["auto"] | dict[str, Any], AfterValidator(_policy_setting)] = "auto"
    gpu_memory: Size = None
    cpu_memory: Size = None
    disk_dir: PathStr | None = None
    dtype: Annotated[str, AfterValidator(_dtype)] = "auto"
    device: Annotated[str, AfterValidator(_device)] = "auto"
    devices: Annotated[Literal["auto"] | list[int | str] | None, BeforeValidator(_devices)] = None
    parallel: Literal["auto", "data", "pipeline"] = "auto"
    compress_weights: bool = False
    compress_cache: bool = False
    trials: Int = Field(0, ge=0)

    def llm_kwargs(self) -> dict[str, Any]:
        """The settings that differ from `LLM`'s defaults, as keyword arguments."""
        return self.model_dump(exclude_defaults=True)


class Example(_Strict):
    """A few-shot example: `input` fills the template's columns, `output` is the ideal answer."""

    input: dict[str, Any]
    output: str | dict[str, Any]


_JSON_TYPES = {"string", "number", "integer", "boolean"}


def schema_from_shorthand(schema: dict[str, Any]) -> dict[str, Any]:
    """Accept a full JSON schema (has `properties`, or `type: object`) or the shorthand
    `{field: "string"|"number"|"integer"|"boolean"|{json schema}}`; return a full object schema."""
    if "properties" in schema or schema.get("type") == "object":
        return schema
    props: dict[str, Any] = {}
    for name, spec in schema.items():
        if isinstance(spec, str):
            if spec not in _JSON_TYPES:
                raise ValueError(f"schema field {name!r}: type {spec!r} is not one of {sorted(_JSON_TYPES)}")
            props[name] = {"type": spec}
        elif isinstance(spec, dict):
            props[name] = spec
        else:
            raise ValueError(f"schema field {name!r}: expected a type name or a JSON schema, got {spec!r}")
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


class LlmMap(_Strict):
    """Generate one value per row into column `output` from `template` (`{column}` placeholders).

    At most one of `schema` (JSON schema or shorthand: struct output), `choices` (one of these strings)
    and `regex` constrains decoding. `unnest: true` turns a struct output into one column per field
    (`unnest: "prefix_"` prefixes them). `error_column` names an optional column holding each row's error,
    `model_column` one holding the model that answered it, `confidence_column` one holding how sure that model
    was (`llmops.core`).
    `model` overrides the pipeline's model for this step. `on_empty` (null | error | run): what a row whose
    placeholder value is empty or whitespace only gives (see `llmops.core.MapSpec`). `cascade: [small, large]`
    with `min_confidence: 0.9` runs every row on the first model and the rows it was unsure of or got wrong
    (an error, an unparsable output, a broken `validate` rule) on the next (`llmops.cascade`); it replaces
    `model`, and `min_confidence` needs a schema, choices or regex."""

    output: str = Field(min_length=1)
    template: str = Field(min_length=1)
    system: str | None = None
    examples: list[Example] = []
    schema_: Annotated[dict[str, Any] | None, AfterValidator(
        lambda s: None if s is None else schema_from_shorthand(s)), AfterValidator(check_json_schema)] = Field(
        None, alias="schema")
    choices: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    regex: Annotated[str | None, AfterValidator(check_regex)] = None
    model: str | None = None
    cascade: list[str] | dict[str, Any] | None = None
    min_confidence: Float | None = None
    max_new_tokens: Int = Field(64, ge=1)
    temperature: Float = Field(0.0, ge=0)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=0)
    seed: Int = 0
    stop: list[str] = []
    chat: bool | None = None
    on_long_prompt: Literal["error", "truncate"] = "error"
    on_empty: Literal["null", "error", "run"] = "null"
    unnest: bool | str = False
    error_column: str | None = None
    model_column: str | None = None
    confidence_column: str | None = None
    validate_: Rules = Field([], alias="validate")  # DuckDB rules on the output (llmops.validate)
    max_attempts: Int = Field(2, ge=1, le=10)
    gleaning: Int | dict[str, Any] | None = None     # refinement rounds (llmops.glean): n or {rounds, min_confidence}

    @field_validator("gleaning")
    @classmethod
    def _gleaning(cls, value: Any, info: ValidationInfo) -> Any:
        as_gleaning(value, constrained=_constrained(info.data))
        if value and "max_attempts" in info.data and info.data["max_attempts"] != 2:
            raise ValueError("give gleaning rounds or max_attempts, not both (gleaning's rounds are the retries)")
        return value

    @field_validator("cascade")
    @classmethod
    def _cascade(cls, value: Any, info: ValidationInfo) -> Any:
        return check_step_cascade(value, info.data.get("model"), constrained=_constrained(info.data))

    @field_validator("min_confidence")
    @classmethod
    def _min_confidence(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and "cascade" in info.data:    # a bad cascade is reported at its own key
            as_cascade(info.data["cascade"], value, constrained=_constrained(info.data))
        return value

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        template_fields(value)           # syntax: bare {column} names only, balanced braces
        return value

    @field_validator("output", "error_column", "model_column", "confidence_column")
    @classmethod
    def _column_name(cls, value: str | None) -> str | None:
        return None if value is None else check_column_name(value)

    @field_validator("choices")
    @classmethod
    def _choices(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else list(check_choices(value))

    @model_validator(mode="after")
    def _output_names(self) -> "LlmMap":
        """The columns this step writes are distinct and none is reserved (unnested fields included)."""
        names = self.written_columns()
        for name in names:
            check_column_name(name)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"llm_map writes column(s) {twice} twice (output, unnested fields, error_column, "
                             "model_column and confidence_column must be distinct)")
        return self

    def written_columns(self) -> list[str]:
        """The columns this step adds to (or sets in) the table."""
        prefix = self.unnest if isinstance(self.unnest, str) else ""
        names = [f"{prefix}{f}" for f in (self.schema_ or {}).get("properties", {})] if self.unnest else [self.output]
        return names + [n for n in (self.error_column, self.model_column, self.confidence_column) if n is not None]

    @model_validator(mode="after")
    def _constraints(self) -> "LlmMap":
        given = [n for n, v in (("schema", self.schema_), ("choices", self.choices), ("regex", self.regex))
                 if v is not None]
        if len(given) > 1:
            raise ValueError(f"llm_map takes at most one of schema, choices, regex; got {', '.join(given)}")
        if self.unnest and self.schema_ is None:
            raise ValueError("llm_map.unnest needs a schema (only struct outputs can be unnested)")
        for i, ex in enumerate(self.examples):
            if self.choices is not None and ex.output not in self.choices:
                raise ValueError(f"examples[{i}].output {ex.output!r} is not one of choices {self.choices}")
            if self.schema_ is not None and not isinstance(ex.output, dict):
                raise ValueError(f"examples[{i}].output must be a mapping matching the schema")
        return self


RESERVED_PREFIX = "__llmops_"   # the hidden columns the runner adds (the row position, retry feedback)


def check_column_name(name: str) -> str:
    """`name` unless it is a reserved column name (starts with RESERVED_PREFIX); ValueError otherwise."""
    if name.startswith(RESERVED_PREFIX):
        raise ValueError(f"column name {name!r} is reserved (names starting with {RESERVED_PREFIX!r} are the "
                         "runner's own hidden columns); choose another name")
    return name


def _constrained(fields: dict[str, Any]) -> bool:
    """Whether the step's fields validated so far constrain its output (schema, choices or regex)."""
    return any(fields.get(name) is not None for name in ("schema_", "choices", "regex"))


class SqlStep(_Strict):
    """Replace the table with a DuckDB query's result; the current table is named `input`."""
    sql: str = Field(min_length=1)


class LlmMapStep(_Strict):
    llm_map: LlmMap


class FilterStep(_Strict):
    """Keep the rows where a DuckDB boolean expression over the columns is true."""
    filter: str = Field(min_length=1)


class DedupeStep(_Strict):
    """Keep the first row for each distinct value of these columns (empty list: all columns)."""
    dedupe: list[str]


def _check_type(name: str) -> str:
    duckdb_type(name)
    return name


class ParseStep(_Strict):
    """Cast columns ({column: type}); a value that does not parse becomes null (TRY_CAST)."""
    parse: dict[str, Annotated[str, AfterValidator(_check_type)]]


class SelectStep(_Strict):
    """Keep these columns, in this order: a list of names, or {new_name: DuckDB expression} (a bare
    column name is an expression: {ident: id, amount: "CAST(replace(total, ',', '') AS DOUBLE)"}).
    Expressions must be row-wise (no aggregates or windows: use a `sql` step for those)."""
    select: list[str] | dict[str, str]


STEP_KINDS: dict[str, type[_Strict]] = {
    "sql": SqlStep, "llm_map": LlmMapStep, "filter": FilterStep, "dedupe": DedupeStep,
    "parse": ParseStep, "select": SelectStep, **SEMANTIC_STEP_KINDS, **OPERATOR_STEP_KINDS,
}
ROW_WISE = (FilterStep, ParseStep, SelectStep)  # steps that can run on each finished batch independently


def step_kind(value: Any) -> str | None:
    """The tag of a step: its single key (a mapping) or its model's kind (an instance)."""
    if isinstance(value, dict):
        return next(iter(value)) if len(value) == 1 else None
    for name, cls in STEP_KINDS.items():
        if isinstance(value, cls):
            return name
    return None


Step = Annotated[
    Union[tuple(Annotated[cls, Tag(name)] for name, cls in STEP_KINDS.items())],  # type: ignore[misc]
    Discriminator(step_kind, custom_error_type="invalid_step",
                  custom_error_message="a step is a mapping with exactly one key, one of: "
                                       + ", ".join(STEP_KINDS)),
]


class Pipeline(_Strict):
    """`source -> steps -> sink` with the model, engine settings and result cache they run with."""

    name: str | None = None
    description: str | None = None
    model: str = "smollm2-135m-instruct"
    engine: EngineSettings = EngineSettings()
    cache_dir: PathStr | Literal[False] | None = None
    source: Source
    steps: list[Step] = []
    sink: Sink

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (YAML-ready) without defaults; `Pipeline.from_dict` reads it back equal."""
        return self.model_dump(mode="json", by_alias=True, exclude_defaults=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Pipeline":
        """Validate a dict (raises pydantic.ValidationError; `load.py` turns it into a PipelineError)."""
        return cls.model_validate(data)

    @property
    def llm_steps(self) -> list[LlmMap]:
        return [s.llm_map for s in self.steps if isinstance(s, LlmMapStep)]
