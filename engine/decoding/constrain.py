"""Grammar-constrained decoding (json_schema / choices / regex) with llguidance.

Why llguidance (measured on SmolLM2's tokenizer, 16 rows, a 3-field JSON schema, a 2-core CPU):
import 0.05 s vs xgrammar's 2.8 s (xgrammar imports transformers, which the engine must not need);
tokenizer info 0.41 s vs 0.26 s (once per process); per-step mask for 16 rows 0.49 ms vs 0.13 ms. Both are
far below a decode step (~100 ms at batch 64), and llguidance's `is_stopped` says when the grammar can
only end, which is how we force EOS: a row whose grammar is complete finishes at once ("stop").

The llguidance tokenizer is built once per (tokenizer.json, EOS ids, vocab size) per process. Masks are
computed into an int32 bitmask with llguidance's numpy path (its thread pool for larger batches), unpacked
(with numpy on the CPU; on a GPU the packed words, 1/8 of the bool mask's bytes, are copied and unpacked
there) and applied with one masked_fill (llguidance's torch helper is torch.compile'd: seconds on the first
call). Masks are computed ahead: once a GPU batch's tokens are chosen and fed, `prefetch` computes its rows'
next masks on one mask thread while the device runs the batch's next step, and `allowed` takes them (or
computes them there and waits). A row's matcher is touched only after its prefetch is done (`_quiet`).

Budget: given each token's `remaining` count, `GrammarConstraint.advance` keeps every row able to complete
its grammar before max_new_tokens: it tracks per row a completion from the current state
(`engine.decoding.closing.closing_path`) and replaces a token after which no completion fits the remaining budget by
the next token of the completion that fit before it. A row whose kept completion still completes the grammar
after its token, with a token to spare, pays one `validate_tokens` call (~1 us); otherwise the search starts
from hints taken from it (`closing.hints_after`: its tail, or its bytes after the token re-tokenized) and walks
the grammar only when none fits and the row is not at its reserve: a row at its reserve keeps its token when
a hint closes in time, else follows its completion (`python benchmarks/operators/grammar_advance.py` times
this per row-token, benchmarks/records/cpu-2core/grammar_advance.jsonl). Only rows at their reserve have tokens
replaced. The decoder feeds a GPU batch's rows in one `advance_rows` call.

A block's matchers are copies of one matcher built from the grammar (`LLMatcher.deep_copy`): building a matcher
compiles the grammar for the tokenizer, copying one does not, and a block of thousands of rows would otherwise
build thousands before its first step.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from engine.decoding.closing import ClosingTokens, accepts_after, closing_path, hints_after
from engine.decoding.params import SamplingParams

if TYPE_CHECKING:
    import llguidance

# JSON output as Python's json.dumps writes it: bounded whitespace, so a model cannot pad forever.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
PARALLEL_ROWS = 16  # from this many rows, masks are computed on llguidance's thread pool (1.7 vs 5.9 ms at 64)


LLGUIDANCE_MIN = (1, 9)      # LLTokenizer(eos_token=[...]), a list of ids (1.6.1 takes one int)


def _llguidance():
    """llguidance, imported on first use (only constrained decoding needs it); an older one than
    `LLGUIDANCE_MIN` is refused with the version found, not left to fail inside a call."""
    try:
        import llguidance  # optional at import time: only constrained decoding needs it
        import llguidance.numpy  # noqa: F401
    except ImportError as exc:
        raise ImportError("constrained decoding (json_schema/choices/regex) needs llguidance: "
                          "pip install llguidance") from exc
    _require(getattr(llguidance, "__version__", "0"))
    return llguidance


@lru_cache(maxsize=4)
def _require(found: str) -> None:
    """Raise unless llguidance `found` is at least `LLGUIDANCE_MIN` (checked once per version: every decode
    step's mask comes through `_llguidance`)."""
    if _version_tuple(found) < LLGUIDANCE_MIN:
        need = ".".join(map(str, LLGUIDANCE_MIN))
        raise ImportError(f"constrained decoding (json_schema/choices/regex) needs llguidance >= {need}, found "
                          f"{found}: pip install -U 'llguidance>={need}'")


def _version_tuple(version: str) -> tuple[int, ...]:
    """(1, 9, 1) for "1.9.1": the leading dotted numbers ("1.10.0rc1" -> (1, 10, 0); none -> ())."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in match.group().split(".")) if match else ()


@lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer_json: str, eos_ids: tuple[int, ...], n_vocab: int) -> "llguidance.LLTokenizer":
    return _llguidance().LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_ids))


def ll_tokenizer(tokenizer_json: str, eos_ids: Sequence[int], n_vocab: int) -> "llguidance.LLTokenizer":
    """The llguidance tokenizer for a tokenizer.json text (~0.4 s to build; cached per process)."""
    if not eos_ids:
        raise ValueError("constrained decoding needs an EOS token id; the tokenizer and config define none")
    return _ll_tokenizer(tokenizer_json, tuple(sorted(set(int(e) for e in eos_ids))), int(n_vocab))


def escape_regex(text: str) -> str:
    """Escape regex metacharacters (Rust regex-syntax's set) so `text` matches literally."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def grammar_for(params: SamplingParams) -> str | None:
    """The llguidance grammar for the constraint in `params`, or None when unconstrained.

    choices -> a regex alternation of the literal strings; regex -> as given (Rust regex syntax, the
    whole output must match); json_schema -> llguidance's JSON compiler with fixed ", " / ": " separators.
    """
    if params.choices is not None:
        choices = list(params.choices)
        if not choices or any(not isinstance(c, str) or c == "" for c in choices):
            raise ValueError(f"SamplingParams.choices must be a non-empty list of non-empty strings, got {choices!r}")
        return _llguidance().LLMatcher.grammar_from_regex("(" + "|".join(escape_regex(c) for c in choices) + ")")
    if params.regex is not None:
        if not isinstance(params.regex, str) or params.regex == "":
            raise ValueError(f"SamplingParams.regex must be a non-empty string, got {params.regex!r}")
        return _llguidance().LLMatcher.grammar_from_regex(params.regex)
    if params.json_schema is not None:
        schema: Any = params.json_schema
        if not isinstance(schema, dict):
            raise ValueError(f"SamplingParams.json_schema must be a dict, got {type(schema).__name__}")
        try:
            return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"SamplingParams.json_schema is not a valid JSON schema: {exc}") from exc
    return None


def _constraint_field(params: SamplingParams) -> str:
    for name in ("json_schema", "choices", "regex"):
        if getattr(params, name) is not None:
            return name
    return "grammar"


def bitmask_to_bool(bitmask: np.ndarray, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """llguidance bitmask int32 [n, w] (bit j of word i = token 32*i + j allowed) -> bool [n, vocab] on `device`.

    Columns past the bitmask's 32*w tokens (a model vocab wider than the tokenizer's) are disallowed. On the
    CPU numpy unpacks the bits; elsewhere the packed words travel from pinned memory, queued behind the
    device's work rather than waiting for it (a pageable copy waits for everything queued before it, the
    step's own forward pass included), and are unpacked there (`unpack_bits`).
    """
    device = torch.device(device)
    n, w = bitmask.shape
    if device.type == "cpu":
        bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")  # [n, 32w]
        allowed = torch.from_numpy(bits.view(np.bool_))                 # [n, 32w]
    else:
        words = torch.from_numpy(np.ascontiguousarray(bitmask)).pin_memory()               # [n, w] int32
        allowed = unpack_bits(words.to(device, non_blocking=True))                         # [n, 32w]
    if w * 32 >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(n, vocab - w * 32, dtype=torch.bool, device=device)
    return torch.cat([allowed, pad], dim=1)                             # [n, vocab]


def unpack_bits(words: torch.Tensor) -> torch.Tensor:
    """int32 [n, w] -> bool [n, 32w]: bit j of word i (least significant first) is column 32*i + j."""
    n, w = words.shape
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)  # [32]
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().view(n, 32 * w)  # [n, w, 32] -> [n, 32w]


@lru_cache(maxsize=1)
def _mask_thread() -> ThreadPoolExecutor:
    """The one thread every grammar mask is computed on (one llguidance executor, never used concurrently)."""
    return ThreadPoolExecutor(1, thread_name_prefix="engine-grammar")


@lru_cache(maxsize=1)
def _executor() -> "llguidance.LLExecutor":
    return _llguidance().LLExecutor()


_PROBES: dict[int, tuple["llguidance.LLTokenizer", ClosingTokens]] = {}


def _closing_tokens(tokenizer: "llguidance.LLTokenizer") -> ClosingTokens:
    """`ClosingTokens.for_tokenizer`, once per llguidance tokenizer (they live for the process: `ll_tokenizer`)."""
    held = _PROBES.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        held = _PROBES[id(tokenizer)] = (tokenizer, ClosingTokens.for_tokenizer(tokenizer))
    return held[1]


class GrammarConstraint:
    """Per-row llguidance matchers for one block: masks of allowed tokens and the grammar's progress.

    Rows are block-row ids 0..num_rows-1. `advance(row, token, remaining)` must be called with every token a
    row emits, in order; it returns the token actually fed (see `advance`) and True once the grammar is
    complete (only EOS could follow).
    """

    def __init__(self, tokenizer: "llguidance.LLTokenizer", grammar: str, num_rows: int, field: str = "grammar"):
        llg = _llguidance()
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"SamplingParams.{field}: invalid constraint: {error}")
        self._tokenizer = tokenizer
        self._eos = frozenset(tokenizer.eos_tokens)
        start = llg.LLMatcher(tokenizer, grammar, log_level=0)           # built once, copied per row
        self._matchers = [start, *(start.deep_copy() for _ in range(num_rows - 1))] if num_rows else []
        self._ahead: dict[tuple[int, ...], Future] = {}     # rows -> their next masks, computing on the mask thread
        self._busy: dict[int, Future] = {}                  # row -> the prefetch reading its matcher
        self._probes = _closing_tokens(tokenizer)
        self._tracked = [False] * num_rows
        self._closings: list[list[int] | None] = [None] * num_rows
        self._fed = [False] * num_rows                      # whether the row's matcher has left the start state
        self._start_closings: dict[int, list[int] | None] = {}   # limit -> the completion from the start state

    @classmethod
    def for_params(cls, params: SamplingParams, tokenizer_json: str, eos_ids: Sequence[int], n_vocab: int,
                   num_rows: int) -> "GrammarConstraint | None":
        """The constraint `params` asks for over `num_rows` rows, or None when it asks for none."""
        grammar = grammar_for(params)
        if grammar is None:
            return None
        return cls(ll_tokenizer(tokenizer_json, eos_ids, n_vocab), grammar, num_rows, _constraint_field(params))

    def allowed(self, rows: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool [len(rows), vocab] on `device`: True where the row's grammar allows the token next. Takes the
        masks `prefetch` computed for exactly these rows, else computes them (after any prefetch reading one
        of these rows' matchers is done; such a prefetch is dropped)."""
        key = tuple(rows)
        pending = self._ahead.pop(key, None)
        if pending is None:
            self.settle(key)
            pending = _mask_thread().submit(self._fill, key)
        mask = pending.result()
        for row in key:
            self._busy.pop(row, None)
        return bitmask_to_bool(mask, vocab, device)

    def prefetch(self, rows: Sequence[int]) -> None:
        """Start computing `rows`' next masks on the mask thread, for the `allowed` call of exactly these rows
        (each of their matchers waits for it before anything else reads or advances it)."""
        key = tuple(rows)
        if not key:
            return
        self.settle(key)
        pending = _mask_thread().submit(self._fill, key)
        self._ahead[key] = pending
        self._busy.update((row, pending) for row in key)

    def settle(self, rows: Sequence[int]) -> None:
        """Wait for the prefetches reading one of `rows`' matchers and drop them (their masks go unused)."""
        wanted = set(rows)
        for key in [k for k in self._ahead if not wanted.isdisjoint(k)]:
            self._ahead.pop(key).exception()                                  # waits
            for row in key:
                self._busy.pop(row, None)

    def _fill(self, rows: tuple[int, ...]) -> np.ndarray:
        """The rows' next-token bitmask int32 [len(rows), w] (runs on the mask thread)."""
        llg_numpy = _llguidance().numpy
        mask = llg_numpy.allocate_token_bitmask(len(rows), self._tokenizer.vocab_size)
        if len(rows) >= PARALLEL_ROWS:
            llg_numpy.fill_next_token_bitmask_par(_executor(), [(self._matchers[r], i) for i, r in enumerate(rows)], mask)
        else:
            for i, row in enumerate(rows):
                llg_numpy.fill_next_token_bitmask(self._matchers[row], mask, i)
        return mask

    def _quiet(self, row: int) -> None:
        """Wait for the prefetch reading the row's matcher, if one is (its masks stay for `allowed`)."""
        pending = self._busy.pop(row, None)
        if pending is not None:
            pending.exception()

    def advance(self, row: int, token: int, remaining: int | None = None) -> tuple[int, bool]:
        """Feed the row's next token; return (the token fed, whether the grammar is now complete).

        remaining: how many more tokens the row may emit after this one (None: no budget, `token` is fed as
        is). With a budget, a token after which the grammar cannot be completed within `remaining` tokens
        is replaced by the next token of the completion kept from the previous step, so a row whose
        grammar could be completed within its budget at its first token always completes it. A row with no
        completion that short from its first token is left alone (it ends "length"). Raises ValueError on a
        token the grammar rejects (cannot happen when tokens were chosen under `allowed`)."""
        self._quiet(row)
        return self._advance(row, token, remaining)

    def advance_rows(self, rows: Sequence[int], tokens: Sequence[int], remaining: Sequence[int] | None = None
                     ) -> tuple[list[int], list[bool], list[str | None]]:
        """`advance` for a GPU batch's rows in one call: (the tokens fed, whether each row's grammar is
        complete, the error of each row whose token the grammar rejected, else None). The same tokens and
        verdicts as `advance` row by row."""
        for row in rows:
            self._quiet(row)
        fed = list(tokens)
        complete: list[bool] = [False] * len(fed)
        errors: list[str | None] = [None] * len(fed)
        for i, row in enumerate(rows):
            try:
                fed[i], complete[i] = self._advance(row, fed[i], None if remaining is None else remaining[i])
            except ValueError as exc:
                errors[i] = str(exc)
        return fed, complete, errors

    def _advance(self, row: int, token: int, remaining: int | None) -> tuple[int, bool]:
        """`advance` once nothing else reads the row's matcher. The common case stays inline: a token that
        is the kept completion's next one leaves the rest of it as the new completion (no search)."""
        matcher = self._matchers[row]
        if remaining is not None and not self._tracked[row]:
            self._tracked[row] = True
            self._closings[row] = self._first_closing(row, remaining + 1)
        if token in self._eos:
            return token, True
        self._consume(row, token)
        closing = self._closings[row]
        if remaining is not None and closing is not None:
            if closing and token == closing[0]:
                self._closings[row] = closing[1:]
            elif len(closing) < remaining and accepts_after(matcher, closing, self._probes.eos):
                pass                                        # the kept completion still fits, with room to spare
            else:
                token = self._keep_closable(row, token, closing, remaining)
                if token in self._eos:
                    return token, True
        return token, matcher.is_stopped()

    def _first_closing(self, row: int, limit: int) -> list[int] | None:
        """`closing_path` of the row's matcher within `limit` tokens; searched once per limit for the rows
        still at the grammar's start (every row of a block begins in the same state: one search, not one a
        row, in the step choosing a block's first tokens)."""
        matcher = self._matchers[row]
        if self._fed[row]:
            return closing_path(matcher, self._tokenizer, self._probes, limit)
        if limit not in self._start_closings:
            self._start_closings[limit] = closing_path(matcher, self._tokenizer, self._probes, limit)
        return self._start_closings[limit]

    def _consume(self, row: int, token: int) -> None:
        self._fed[row] = True
        matcher = self._matchers[row]
        if not matcher.consume_token(token):
            raise ValueError(f"grammar rejected token {token} on row {row}: {matcher.get_error()}")

    def _keep_closable(self, row: int, token: int, closing: list[int], remaining: int) -> int:
        """After `token` was consumed: keep a completion of at most `remaining` tokens, replacing `token`
        by `closing[0]` (or EOS when `closing` is empty) when none exists after it. Returns the token fed.
        A row at its reserve (`closing` no longer fits after a token) keeps its token only when a hint
        completes the grammar in time: the grammar is not walked for a shorter completion than the kept one."""
        matcher = self._matchers[row]
        hints = hints_after(self._tokenizer, closing, token)
        after = closing_path(matcher, self._tokenizer, self._probes, remaining, hints, walk=len(closing) <= remaining)
        if after is None:
            matcher.rollback(1)
            if not closing:
                self._closings[row] = []
                return self._probes.eos
            token, after = closing[0], closing[1:]
            self._consume(row, token)
        self._closings[row] = after
        return token

    def is_accepting(self, row: int) -> bool:
        """True when the row's output so far is a complete match (it may still continue)."""
        self._quiet(row)
        return self._matchers[row].is_accepting()
