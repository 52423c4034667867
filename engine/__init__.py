"""llmops' offloading inference engine. Imports no operator-layer library (Polars, DuckDB, Ray, click)."""
from engine.params import Completion, SamplingParams
from engine.policy.policy import Policy

__all__ = ["LLM", "Completion", "SamplingParams", "Policy"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
