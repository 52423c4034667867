"""Pipeline steps for the document and ranking operators: `llm_topk`, `llm_extract`, `embed`, `sim_join`,
`split`, `gather` (registered in `spec.STEP_KINDS` beside the semantic steps of `semantic_spec`).

    - split: {column: body, chunk_size: 400, overlap: 50, unit: chars, id_column: id}
    - llm_map: {output: note, template: "Summarise: {chunk}"}
    - gather: {column: note, by: doc_id, template: "Combine these notes:\\n{rows}", output: summary}
    - llm_topk: {template: "Which {subject} is the most urgent?", k: 5}
    - llm_extract: {column: body, fields: {invoice_number: the invoice number, total: the amount due}}
    - embed: {column: subject, output: subject_embedding}
    - sim_join: {right: "SELECT * FROM 'faq.csv'", left_on: [subject], right_on: [question], k: 1}

Checked at load, without a model: unknown keys, numbers, templates (through the step's `MapSpec`), field names.
Steps that generate share `llm_map`'s generation keys (`LlmOptions`); the others take only `model` (the
tokenizer of `split` by tokens, the embedding model of `embed` / `sim_join`), so no setting is accepted and
left unused. Columns are checked when the step runs, naming the step.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from llmops.pipeline.semantic_spec import LlmOptions, Num, Real, _Model
from llmops.semantic.extract import SYSTEM as EXTRACT_SYSTEM, extract_template
from llmops.semantic.reduce import ROWS
from llmops.semantic.topk import pair_template

Name = Annotated[str, Field(min_length=1)]


class ModelOnly(_Model):
    """A step that runs the model without generating: `model` overrides the pipeline's."""

    model: str | None = None
    cascade: None = None        # no cascade: nothing is generated (the dry run asks every step)


class LlmTopK(LlmOptions):
    """The `k` rows that best answer `template`'s question, best first, with their place in `rank`."""

    template: str = Field(min_length=1)
    k: Num = Field(ge=1)
    rank: Name = "rank"
    seed: Num = 0

    @model_validator(mode="after")
    def _check(self) -> "LlmTopK":
        self.check_template(pair_template(self.template), choices=("A", "B"))
        return self


class LlmExtract(LlmOptions):
    """A struct column `output` of `fields` (names, or {name: description}) taken from `column`; with `quotes`
    each value is a verbatim span of the text (others null, `<output>_error` says which)."""

    column: Name
    fields: list[Name] | dict[Name, str] = Field(min_length=1)
    quotes: bool = True
    output: Name = "extracted"
    gleaning: Num = Field(1, ge=0, le=5)

    @model_validator(mode="after")
    def _check(self) -> "LlmExtract":
        named = self.fields if isinstance(self.fields, dict) else {f: "" for f in self.fields}
        self.check_template(extract_template(named, self.quotes), system=self.system or EXTRACT_SYSTEM)
        return self


class Embed(ModelOnly):
    """A list<float32> column `output` with the embedding of `column` (several columns: their values joined)."""

    column: Name | list[Name]
    output: Name = "embedding"


class SimJoin(ModelOnly):
    """Pairs of the current table (left) and `right` (a DuckDB query) by embedding similarity of `left_on` /
    `right_on`: each left row's `k` nearest right rows and/or those at or above `threshold`."""

    right: Name
    left_on: list[Name] = Field(min_length=1)
    right_on: list[Name] | None = None
    k: Num | None = Field(None, ge=1)
    threshold: Real | None = Field(None, ge=-1, le=1)
    suffix: str = "_right"

    @model_validator(mode="after")
    def _check(self) -> "SimJoin":
        if self.k is None and self.threshold is None:
            raise ValueError("sim_join needs k (nearest rows per left row) or threshold (a minimum cosine similarity)")
        return self


class Split(ModelOnly):
    """One row per chunk of `column`: the other columns, `doc_id` (`id_column` or the row index),
    `chunk_index`, `chunk`; `overlap` units shared by consecutive chunks; unit chars or tokens (the model's)."""

    column: Name
    chunk_size: Num = Field(ge=1)
    overlap: Num = Field(0, ge=0)
    unit: Literal["chars", "tokens"] = "chars"
    id_column: Name | None = None

    @model_validator(mode="after")
    def _check(self) -> "Split":
        if self.overlap >= self.chunk_size:
            raise ValueError(f"split.overlap ({self.overlap}) must be smaller than chunk_size ({self.chunk_size})")
        return self


class Gather(LlmOptions):
    """One row per document (`by`): the chunks' `column` values in `order`, joined with `separator`, or with a
    `template` (`{rows}`: the values, one per line) reduced by the model (`schema` / `choices` constrain it)."""

    column: Name
    by: list[Name] = Field(["doc_id"], min_length=1)
    order: Name = "chunk_index"
    output: Name | None = None
    separator: str = "\n"
    template: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    choices: list[Name] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "Gather":
        if self.template is None:
            generating = sorted(k for k in self.model_fields_set if k in LlmOptions.model_fields or k in
                                ("schema_", "choices"))
            if generating:
                raise ValueError(f"gather: {', '.join(generating)} only apply with a template (the model reduces "
                                 "the chunks); without one the values are joined")
            return self
        if "{" + ROWS + "}" not in self.template:
            raise ValueError(f"gather template {self.template!r} must contain {{{ROWS}}} (the document's values)")
        if self.schema_ and self.choices:
            raise ValueError("gather takes at most one of schema, choices")
        self.check_template(self.template, schema=self.schema_, choices=tuple(self.choices) if self.choices else None)
        return self


class LlmTopKStep(_Model):
    llm_topk: LlmTopK


class LlmExtractStep(_Model):
    llm_extract: LlmExtract


class EmbedStep(_Model):
    embed: Embed


class SimJoinStep(_Model):
    sim_join: SimJoin


class SplitStep(_Model):
    split: Split


class GatherStep(_Model):
    gather: Gather


OPERATOR_STEP_KINDS: dict[str, type[_Model]] = {
    "llm_topk": LlmTopKStep, "llm_extract": LlmExtractStep, "embed": EmbedStep, "sim_join": SimJoinStep,
    "split": SplitStep, "gather": GatherStep,
}
OPERATOR_STEPS = tuple(OPERATOR_STEP_KINDS.values())
