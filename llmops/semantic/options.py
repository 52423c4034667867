"""What every semantic operator shares: how its LLM calls are made (`Llm`) and how a spec is built.

`Llm` gathers the run options of one operator call (model, generation settings, result cache, progress, the
engine object, validation rules and attempts); `Llm.spec(template, ...)` builds the `MapSpec` and
`Llm.run(table, spec)` runs it through `llmops.validate.run_checked`, i.e. through `llmops.core.map_table`:
one job per call over the whole table of prompts (dedup, result cache, data marking, one plan), never a
call per row or per pair. Generation keywords are `MapSpec`'s (system, examples, max_new_tokens,
temperature, top_p, top_k, seed, stop, chat, on_long_prompt, on_empty, cascade, min_confidence) plus
`engine_settings`. A cascade (`llmops.cascade`) is best given as one mapping, `cascade={"models": [small,
large], "min_confidence": 0.9}`: `llm_join`'s own `min_confidence` is its pair threshold.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from llmops.core import CacheDir, MapSpec
from llmops.summary import RunSummary
from llmops.validate import Checked, run_checked

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class Llm:
    """Run options of one semantic operator call; `summary` adds up all its LLM calls."""

    model: str = DEFAULT_MODEL
    generation: Mapping[str, Any] = field(default_factory=dict)
    validate: Sequence[str] = ()
    max_attempts: int = 2
    cache_dir: CacheDir = None
    progress: bool | None = None
    engine: Any = None
    summary: RunSummary = field(default_factory=lambda: RunSummary(calls=0))

    @classmethod
    def of(cls, *, model: str = DEFAULT_MODEL, validate: str | Sequence[str] = (), max_attempts: int = 2,
           cache_dir: CacheDir = None, progress: bool | None = None, engine: Any = None,
           **generation: Any) -> Llm:
        """From an operator's keyword arguments (`validate` a rule or a list of rules)."""
        rules = (validate,) if isinstance(validate, str) else tuple(validate)
        return cls(model, dict(generation), rules, max_attempts, cache_dir, progress, engine)

    def spec(self, template: str, **constraint: Any) -> MapSpec:
        """The MapSpec for `template` with this call's settings; `constraint` (choices, schema, regex,
        max_new_tokens, system...) overrides the generation settings."""
        settings = {**self.generation, **{k: v for k, v in constraint.items() if v is not None}}
        engine = settings.pop("engine_settings", None) or settings.pop("engine", None) or {}
        if settings.get("examples") is not None:      # stop and choices go as given: MapSpec checks them
            settings["examples"] = tuple(settings["examples"])
        return MapSpec(template=template, model=self.model, engine=tuple(dict(engine).items()), **settings)

    def run(self, table: pa.Table, spec: MapSpec, *, output_name: str = "output") -> Checked:
        """Run `spec` over `table` (validated and retried when rules are set)."""
        result = run_checked(table, spec, rules=self.validate, max_attempts=self.max_attempts,
                             output_name=output_name, cache_dir=self.cache_dir, progress=self.progress,
                             engine=self.engine)
        self.summary.add(result.summary)
        return result
