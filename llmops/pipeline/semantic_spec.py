"""Pipeline steps for the semantic operators (`llmops.semantic`): `llm_filter`, `llm_reduce`, `resolve`,
`llm_join`, and the `validate` / `max_attempts` keys every LLM step shares. Registered in `spec.STEP_KINDS`.

    - llm_filter: {template: "Is this ticket a bug report? {body}", reason: why}
    - llm_reduce: {by: [category], template: "Summarise these tickets:\\n{rows}", item: "- {subject}", output: summary}
    - resolve: {columns: [name, city], blocking: {keys: [phone], threshold: 0.4}, output: entity_id, id_column: id}
    - llm_join: {right: "SELECT * FROM 'shop_b.csv'", left_on: [title], right_on: [name], min_confidence: 1}
    - llm_map: {output: total, template: "...", schema: {total: number}, validate: "total.total > 0", max_attempts: 3}

Checked at load, without a model: unknown keys, numbers, the template syntax, few-shot examples against
the template, a schema's shape (by building the step's `MapSpec`), the blocking settings, and that every
`validate` rule parses as a DuckDB expression. Columns are checked when the step runs, naming the step.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from llmops.cascade import check_step_cascade
from llmops.core import MapSpec
from llmops.semantic.blocking import Blocking
from llmops.semantic.embed_blocking import AnyBlocking, EmbeddingBlocking
from llmops.semantic.compare import TEMPLATE as COMPARE_TEMPLATE
from llmops.semantic.reduce import ROWS
from llmops.validate import check_rule_syntax


def _no_bool(value: Any) -> Any:
    """YAML's true/false are not numbers."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
    return value


def _rules(value: Any) -> Any:
    """One rule or a list of rules -> a list, each a DuckDB expression."""
    rules = [value] if isinstance(value, str) else value
    if isinstance(rules, list):
        for rule in rules:
            if isinstance(rule, str):
                check_rule_syntax(rule)
    return rules


Num = Annotated[int, BeforeValidator(_no_bool)]
Real = Annotated[float, BeforeValidator(_no_bool), Field(allow_inf_nan=False)]   # .nan and .inf: no numbers
Rules = Annotated[list[Annotated[str, Field(min_length=1)]], BeforeValidator(_rules)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Checks(_Model):
    """`validate`: DuckDB rules the output must satisfy (failing rows retried with the failure fed back, at
    most `max_attempts` runs in all, then kept as error rows naming the rule)."""

    validate_: Rules = Field([], alias="validate")
    max_attempts: Num = Field(2, ge=1, le=10)


class LlmOptions(Checks):
    """The generation settings of a semantic step (as `llm_map`'s); `model` overrides the pipeline's.
    `cascade`: models that answer in turn (`llmops.cascade`), a list or `{models: [...], min_confidence: x}`
    (one mapping, as `llm_join`'s own `min_confidence` is its pair threshold); it replaces `model`."""

    model: str | None = None
    cascade: list[str] | dict[str, Any] | None = None
    system: str | None = None
    examples: list[dict[str, Any]] = []
    max_new_tokens: Num | None = Field(None, ge=1)
    temperature: Real = Field(0.0, ge=0)
    seed: Num = 0
    on_long_prompt: Literal["error", "truncate"] = "error"

    @field_validator("cascade")
    @classmethod
    def _cascade(cls, value: Any, info: ValidationInfo) -> Any:
        # the models and the threshold; the output: check_template
        return check_step_cascade(value, info.data.get("model"), constrained=True)

    def generation(self) -> dict[str, Any]:
        """The MapSpec keywords this step sets (None: the operator's default)."""
        out = {"system": self.system, "examples": tuple(self.examples) or None, "temperature": self.temperature,
               "seed": self.seed, "on_long_prompt": self.on_long_prompt, "max_new_tokens": self.max_new_tokens,
               "cascade": self.cascade}
        return {k: v for k, v in out.items() if v is not None}

    def check_template(self, template: str, **constraint: Any) -> None:
        """Build the step's MapSpec once, so template, examples and schema errors surface at load."""
        MapSpec(template=template, **{**self.generation(), **{k: v for k, v in constraint.items() if v is not None}})


def _method_only(value: Any) -> Any:
    """`blocking: embedding` (or `qgram`) is the method with its defaults."""
    return {"method": value} if isinstance(value, str) else value


class BlockingSettings(_Model):
    """`llmops.semantic.blocking.Blocking` as YAML: keys, q, threshold (null: keys only), top_k, max_posting; or
    with `method: embedding` an `llmops.semantic.embed_blocking.EmbeddingBlocking`: keys, top_k, threshold (a
    minimum cosine similarity; default none) and `model`. `blocking: embedding` is that method's defaults."""

    method: Literal["qgram", "embedding"] = "qgram"
    keys: list[str] = []
    q: Num = Field(3, ge=1, le=8)
    threshold: Real | None = Field(0.35, ge=-1, le=1)
    top_k: Num = Field(10, ge=1)
    max_posting: Num = Field(200, ge=2)
    model: str | None = None

    @model_validator(mode="after")
    def _valid(self) -> "BlockingSettings":
        wrong = sorted({"q", "max_posting"} & self.model_fields_set if self.method == "embedding" else
                       {"model"} & self.model_fields_set)
        if wrong:
            raise ValueError(f"blocking method {self.method} takes no {', '.join(wrong)}")
        self.blocking()
        return self

    def blocking(self) -> AnyBlocking:
        if self.method == "embedding":
            threshold = self.threshold if "threshold" in self.model_fields_set else None
            return EmbeddingBlocking(tuple(self.keys), self.top_k, threshold, self.model)
        if self.threshold is not None and self.threshold < 0:
            raise ValueError(f"blocking.threshold (q-gram Jaccard) must be in [0, 1], got {self.threshold}")
        return Blocking(tuple(self.keys), self.q, self.threshold, self.top_k, self.max_posting)


Blocks = Annotated[BlockingSettings, BeforeValidator(_method_only)]


class LlmFilter(LlmOptions):
    """Keep the rows the model answers Yes for; `reason` names a column for the model's reason."""

    template: str = Field(min_length=1)
    reason: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "LlmFilter":
        self.check_template(self.template, choices=("Yes", "No"))
        return self


class LlmReduce(LlmOptions):
    """One row per group of `by`: `template` over `{rows}` (the group's rows rendered with `item`)."""

    by: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    template: str = Field(min_length=1)
    item: str | None = None
    output: str = "output"
    fold_template: str | None = None
    max_prompt_tokens: Num | None = Field(None, ge=16)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    choices: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    regex: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "LlmReduce":
        given = [n for n, v in (("schema", self.schema_), ("choices", self.choices), ("regex", self.regex)) if v]
        if len(given) > 1:
            raise ValueError(f"llm_reduce takes at most one of schema, choices, regex; got {', '.join(given)}")
        for t in (self.template, self.fold_template):
            if t is not None and "{" + ROWS + "}" not in t:
                raise ValueError(f"llm_reduce template {t!r} must contain {{{ROWS}}} (the group's rows)")
            if t is not None:
                self.check_template(t, schema=self.schema_, choices=tuple(self.choices) if self.choices else None,
                                    regex=self.regex)
        return self


class Resolve(LlmOptions):
    """Entity resolution: compare candidate pairs on `columns` (`on` in Python; YAML reads a bare `on` key as
    the boolean true), write each row's entity id to `output`."""

    columns: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    blocking: Blocks = BlockingSettings()
    template: str | None = None
    output: str = "entity_id"
    id_column: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "Resolve":
        self.check_template(self.template or COMPARE_TEMPLATE, choices=("Same", "Different"))
        return self


class LlmJoin(LlmOptions):
    """Match the current table (left) with `right` (a DuckDB query) on `left_on` / `right_on`; the table
    becomes the matched pairs with `similarity` and `confidence`."""

    right: str = Field(min_length=1)
    left_on: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    right_on: list[Annotated[str, Field(min_length=1)]] | None = None
    blocking: Blocks = BlockingSettings()
    template: str | None = None
    min_confidence: Real = Field(0.5, gt=0, le=1)
    suffix: str = "_right"

    @model_validator(mode="after")
    def _check(self) -> "LlmJoin":
        if self.right_on is not None and len(self.right_on) != len(self.left_on):
            raise ValueError(f"llm_join: right_on {self.right_on} must name as many columns as left_on {self.left_on}")
        self.check_template(self.template or COMPARE_TEMPLATE, choices=("Same", "Different"))
        return self


class LlmFilterStep(_Model):
    llm_filter: LlmFilter


class LlmReduceStep(_Model):
    llm_reduce: LlmReduce


class ResolveStep(_Model):
    resolve: Resolve


class LlmJoinStep(_Model):
    llm_join: LlmJoin


SEMANTIC_STEP_KINDS: dict[str, type[_Model]] = {
    "llm_filter": LlmFilterStep, "llm_reduce": LlmReduceStep, "resolve": ResolveStep, "llm_join": LlmJoinStep,
}
SEMANTIC_STEPS = tuple(SEMANTIC_STEP_KINDS.values())


def step_config(step: Any) -> LlmOptions:
    """The operator settings of a semantic step (its single field)."""
    return getattr(step, next(iter(type(step).model_fields)))
