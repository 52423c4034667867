"""The decoding controller of one block: a `TokenSelector` (engine/runtime/selector.py) with per-row state.

It owns, per block row: the generated token ids, their logprobs, the grammar matcher, the incremental
detokenizer for stop strings, why the row finished and, under a constraint, the row's confidence, folded
token by token from the masked logits the choice was made from (`engine.decoding.confidence`: no second
pass). The choice of tokens is vectorised over the rows of a GPU batch (one masked argmax or one
inverse-CDF draw); only the per-row bookkeeping (append, EOS, grammar advance, stop-string check) is a
Python loop.

Finish reasons: "stop" for an EOS token, a stop string or a completed grammar (also a grammar that accepts
when the row reaches max_new_tokens); "length" when a row reaches its max_new_tokens first. A constrained
row keeps enough of its budget to complete its grammar: the constraint replaces a token after which the
grammar could no longer be completed in time (`GrammarConstraint.advance`), so a constrained row ends
"length" only when the shortest completion the search finds is longer than its max_new_tokens. A generated EOS
token stays in `token_ids` but never in the text; a stop string is cut from the text (its tokens stay in
`token_ids`); a replaced token is recorded as the token fed, with its own logprob.

Row-finish hook: `on_finished(row, completion)` is called once per row, from inside the call that records
the row's last token (on the executor's decode loop, before the block ends), with the row's final
Completion (text decoded then); `completions()` returns those same objects. Rows the executor never
reached are not passed to it (they only exist as "length" rows in `completions()`). Step hook: `on_step(tokens)`
is called at the end of every call (a GPU batch's first tokens after its prefill, or one decode step), with
the number of tokens chosen in it, so a caller can show progress while a block decodes.

Grammar masks: a GPU batch's next masks start on the mask thread at `end_step`, the executor's hook once every
GPU batch of the step has chosen (`engine.runtime.selector`).

Timing: `grammar_s` and `callback_s` hold the seconds this decoder spent in the grammar (masks and
advances; a mask computed ahead on the mask thread counts only the time the call waits for it) and in
`on_finished`, per phase (`advance_s`: the part of `grammar_s` feeding the chosen tokens to the grammar,
`GrammarConstraint.advance_rows`, over both phases): "prefill" for the call choosing the rows' first token, "decode"
for every later one (`engine.runtime.run_stats` charges them apart from the executor's step times).
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from engine.decoding import confidence as conf
from engine.decoding.constrain import GrammarConstraint
from engine.decoding.params import Completion, FinishReason, SamplingParams
from engine.decoding.sampling import chosen_logprobs, greedy, sample, uniforms
from engine.decoding.tokenizer import IncrementalDetokenizer, Tokenizer


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to the earliest occurrence of any stop string, and whether one occurred."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class BlockDecoder:
    """Chooses tokens for the rows of one block and records them; call `completions()` after the block.

    prompts: the block's prompt token ids (row r = prompts[r]); max_new_tokens: per row; keys: per-row
    sampling keys (engine.decoding.sampling.sequence_keys), required when params.temperature > 0; tokenizer: needed
    for stop strings and text (None: text stays empty); constraint: the block's grammar matchers or None.
    on_finished: called as `on_finished(row, completion)` when a row finishes (see the module docstring); it
    runs on the decode loop, so it must be quick, and an exception it raises aborts the block. on_step: called
    as `on_step(tokens)` after each call (see the module docstring), under the same duties.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], params: SamplingParams,
                 *, eos_ids: Iterable[int], tokenizer: Tokenizer | None = None, keys: Sequence[int] | None = None,
                 constraint: GrammarConstraint | None = None,
                 on_finished: Callable[[int, Completion], None] | None = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} prompts")
        if params.temperature > 0 and (keys is None or len(keys) != len(prompts)):
            raise ValueError("sampling (temperature > 0) needs one key per prompt")
        if params.stop and tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; this model has none")
        self.params = params
        self.prompt_lens = [len(p) for p in prompts]
        self.max_new_tokens = list(max_new_tokens)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.tokenizer = tokenizer
        self.constraint = constraint
        self.keys = None if keys is None else np.asarray([int(k) for k in keys], dtype=np.uint64)
        n = len(prompts)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] | None = [[] for _ in range(n)] if params.logprobs else None
        self.finish: list[FinishReason | None] = [None] * n
        self.errors: list[str | None] = [None] * n
        self._fold = conf.fold_for(params) if constraint is not None else None
        self._confidence = [0.0] * n   # per row: the folded log-probability (see engine.decoding.confidence)
        self.on_finished = on_finished
        self.on_step = on_step
        self._done: dict[int, Completion] = {}   # rows finished and reported to on_finished
        self.grammar_s = {"prefill": 0.0, "decode": 0.0}
        self.advance_s = 0.0
        self.callback_s = {"prefill": 0.0, "decode": 0.0}
        self._next_masks: list[list[int]] = []   # per GPU batch chosen this step: its rows still running
        self._stop_hit = [False] * n
        self._stops = tuple(s for s in params.stop if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._detok: list[IncrementalDetokenizer] | None = (
            [tokenizer.detokenizer() for _ in range(n)] if self._stops and tokenizer is not None else None
        )

    def __call__(self, rows: Sequence[int], logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """TokenSelector: logits [len(rows), vocab] (float32 or the model's dtype) -> (token per row, finished per
        row)."""
        rows = list(rows)
        for row in rows:
            if self.finish[row] is not None:
                raise RuntimeError(f"block row {row} was fed again after it finished ({self.finish[row]})")
        phase = "decode" if rows and self.tokens[rows[0]] else "prefill"
        scores = logits
        if self.constraint is not None:
            if self._next_masks:                 # chosen again before `end_step`: `allowed` computes them
                now = set(rows)
                self._next_masks = [k for k in self._next_masks if now.isdisjoint(k)]
            began = time.perf_counter()
            allowed = self.constraint.allowed(rows, logits.shape[-1], logits.device)      # [n, v]
            scores = logits.masked_fill(~allowed, float("-inf"))                        # [n, v]
            self.grammar_s[phase] += time.perf_counter() - began
        if self.params.temperature == 0:
            chosen = greedy(scores)                                                      # [n]
        else:
            steps = [len(self.tokens[r]) for r in rows]
            u = torch.from_numpy(uniforms(self.keys[rows], steps))                       # [n] float64
            chosen = sample(scores, u, temperature=self.params.temperature, top_k=self.params.top_k,
                            top_p=self.params.top_p)                                     # [n]
        tokens = chosen.tolist()
        verdicts: list[FinishReason | None] = [None] * len(rows)
        if self.constraint is not None:
            began = time.perf_counter()
            tokens, verdicts = self._advance_grammar(rows, tokens)
            spent = time.perf_counter() - began
            self.grammar_s[phase] += spent
            self.advance_s += spent
        lps = None
        if self.logprobs is not None or self._fold is not None:
            fed = torch.tensor(tokens, dtype=chosen.dtype, device=chosen.device)                # [n]
            if self.logprobs is not None:
                lps = chosen_logprobs(logits, fed).tolist()
            if self._fold is not None:
                cps = chosen_logprobs(scores, fed).tolist()                   # log q_t: under the grammar's mask
                for i, row in enumerate(rows):
                    self._confidence[row] = conf.fold(self._fold, self._confidence[row], cps[i])
        finished = [self._record(row, tokens[i], None if lps is None else lps[i], verdicts[i])
                    for i, row in enumerate(rows)]
        if self.on_finished is not None:
            ended = [row for row, done in zip(rows, finished) if done]
            for row, text in zip(ended, self._text(ended)):                 # one batched decode per step
                self._done[row] = self._completion(row, text)
                began = time.perf_counter()
                self.on_finished(row, self._done[row])
                self.callback_s[phase] += time.perf_counter() - began
        if self.constraint is not None:       # the rows' next masks, started at `end_step`
            alive = [row for row, done in zip(rows, finished) if not done]
            if alive:
                self._next_masks.append(alive)
        if self.on_step is not None:
            began = time.perf_counter()
            self.on_step(len(rows))
            self.callback_s[phase] += time.perf_counter() - began
        return tokens, finished

    def end_step(self) -> None:
        """Every GPU batch of the step has chosen (the executor's hook, `engine.runtime.selector`): start the
        next masks of the rows still running, one mask-thread job per GPU batch, while the device runs their
        next step. Started at each batch's own call instead, a block of several GPU batches computes batch k's
        masks on llguidance's threads while the main thread advances batch k + 1's grammars, and both slow
        down. A batch chosen again before `end_step` computes its masks in its `allowed` call."""
        if self.constraint is not None:
            for rows in self._next_masks:
                self.constraint.prefetch(rows)
        self._next_masks = []

    def _advance_grammar(self, rows: list[int], tokens: list[int]) -> tuple[list[int], list[FinishReason | None]]:
        """Feed the rows' tokens to their grammars with each row's remaining budget: (the tokens fed, per row
        "stop" when its grammar is complete, "error" when it rejected the token, else None)."""
        remaining = [self.max_new_tokens[row] - len(self.tokens[row]) - 1 for row in rows]
        fed, complete, errors = self.constraint.advance_rows(rows, tokens, remaining)
        verdicts: list[FinishReason | None] = []
        for row, done, error in zip(rows, complete, errors):
            if error is not None:
                self.errors[row] = error
            verdicts.append("error" if error is not None else "stop" if done else None)
        return fed, verdicts

    def _record(self, row: int, token: int, logprob: float | None, grammar: FinishReason | None) -> bool:
        """Append `token` to `row`; decide whether the row is finished and why (`grammar`: the grammar's
        verdict on the token, from `_advance_grammar`)."""
        self.tokens[row].append(token)
        if self.logprobs is not None:
            self.logprobs[row].append(logprob)
        reason: FinishReason | None = None
        if token in self.eos_ids:
            reason = "stop"
        else:
            reason = grammar
            if reason is None and self._detok is not None and self._stop_string_seen(row, token):
                self._stop_hit[row] = True
                reason = "stop"
        if reason is None and len(self.tokens[row]) >= self.max_new_tokens[row]:
            complete = self.constraint is not None and self.constraint.is_accepting(row)
            reason = "stop" if complete else "length"
        self.finish[row] = reason
        return reason is not None

    def _stop_string_seen(self, row: int, token: int) -> bool:
        detok = self._detok[row]
        before = len(detok.text)
        piece = detok.push(token)
        if not piece:
            return False
        window = detok.text[max(0, before - self._max_stop + 1):]
        return any(s in window for s in self._stops)

    def completions(self) -> list[Completion]:
        """One Completion per block row, in row order. A row the executor never reached is "length"."""
        rest = [row for row in range(len(self.tokens)) if row not in self._done]
        texts = dict(zip(rest, self._text(rest)))
        return [self._done[row] if row in self._done else self._completion(row, texts[row])
                for row in range(len(self.tokens))]

    def _text(self, rows: list[int]) -> list[str]:
        """The decoded text of each of `rows` (a final EOS token not included; "" without a tokenizer)."""
        if self.tokenizer is None or not rows:
            return [""] * len(rows)
        visible = [ids[:-1] if ids and ids[-1] in self.eos_ids else ids for ids in (self.tokens[r] for r in rows)]
        return self.tokenizer.decode_batch(visible)

    def _completion(self, row: int, text: str) -> Completion:
        reason = self.finish[row] or "length"
        if self._stop_hit[row]:
            text, _ = cut_at_stop(text, self._stops)
        if reason == "error":
            text = ""
        return Completion(
            text=text, token_ids=list(self.tokens[row]), finish_reason=reason,
            prompt_tokens=self.prompt_lens[row],
            logprobs=None if self.logprobs is None else list(self.logprobs[row]),
            error=self.errors[row],
            confidence=(conf.confidence(self._confidence[row]) if self._fold is not None and reason == "stop"
                        else None),
        )
