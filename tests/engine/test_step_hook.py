"""`LLM.stream(..., on_step=...)`: the decode loop reports every step's tokens while a block runs, so a caller
can show progress before the block's rows finish (tiny random Llama on the CPU)."""
from __future__ import annotations

from engine import LLM, Policy, SamplingParams

MAX_NEW = 6


def test_on_step_reports_every_token_as_the_block_decodes(tiny_llama):
    prompts = [[1, 5, 9, 13][: 2 + i % 3] for i in range(6)]
    events: list[tuple[str, int]] = []
    with LLM(tiny_llama, dtype="float32", device="cpu", policy=Policy(gpu_batch_size=3, num_gpu_batches=1)) as llm:
        groups = list(llm.stream(prompts, SamplingParams(max_new_tokens=MAX_NEW),
                                 on_step=lambda tokens: events.append(("step", tokens)),
                                 on_finished=lambda i, c: events.append(("row", i))))
    completions = [c for g in groups for _, c in g]
    steps = [n for kind, n in events if kind == "step"]
    kinds = [kind for kind, _ in events]
    assert sum(steps) == sum(len(c.token_ids) for c in completions)
    assert len(steps) >= max(len(c.token_ids) for c in completions)        # a step per token position at least
    assert all(0 < n <= 3 for n in steps)                                   # never more than a GPU batch's rows
    assert kinds.index("row") > 0 and kinds[0] == "step"                   # steps come before any row finishes
