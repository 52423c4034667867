"""Closing a grammar inside a token budget: a short completion of an llguidance matcher's current state.

`closing_path(matcher, tokenizer, probes, limit)` returns token ids that take the grammar from its current
state to an accepting one (at most `limit` of them, never more than `MAX_CLOSING`), or None when this search
finds none that short. It works on a
copy of the matcher, step by step: the grammar's forced bytes when there are any (object keys, separators);
else, inside a free JSON string, the longest valid closer (`"}`, `"]`, `"`); else the longest valid
container closer (`}]`, `}`, `]`), then the smallest value of the expected type (`""`, `0`, `false`,
`null`, `{}`, `[`, `{`); else the grammar's own mask, preferring a token after which the grammar accepts,
then the lowest token id. The result is a completion, the shortest this greedy search finds, not a proven
minimum; its length is what a row must keep in reserve. Cost: one matcher copy and one consume per step
(~40 us a step on SmolLM2's tokenizer); a JSON closing is a handful of steps.

`ClosingTokens.for_tokenizer` finds the single-token spellings of those probes in one tokenizer's vocab.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import llguidance

_STRING_CLOSERS = ['"' + "".join(c) for n in range(3, -1, -1) for c in itertools.product("}]", repeat=n)]
_CONTAINER_CLOSERS = ["".join(c) for n in range(4, 0, -1) for c in itertools.product("}]", repeat=n)]
_SMALL_VALUES = ['""', "0", "false", "null", "{}", "[]", "[", "{"]
_LETTER = "a"          # valid next only inside a free string: tells "in a string" from "at a value"
_SCAN = 128            # allowed tokens scanned for one that completes the grammar, in the mask fallback
MAX_CLOSING = 256      # longest completion searched for: bounds one search at ~10 ms


@dataclass(frozen=True)
class ClosingTokens:
    """Token ids the closing search probes, for one tokenizer. letter: a plain letter's id (None when no
    single token spells it); in_string / outside: candidates in order of preference; eos: the id fed to
    ask "does the grammar accept here?"."""

    letter: int | None
    in_string: tuple[int, ...]
    outside: tuple[int, ...]
    eos: int

    @classmethod
    def for_tokenizer(cls, tokenizer: "llguidance.LLTokenizer") -> "ClosingTokens":
        """The single-token spellings of the probes in `tokenizer` (spellings of two or more tokens are left out)."""
        def single(texts: list[str]) -> tuple[int, ...]:
            ids = [tokenizer.tokenize_str(t) for t in texts]
            return tuple(dict.fromkeys(i[0] for i in ids if len(i) == 1))

        letter = single([_LETTER])
        # outside a free string (the letter probe fails), a string closer comes before the small values: a
        # string with a pattern or enum rejects letters but is still closed by a quote once it matches
        outside = tuple(dict.fromkeys(single(_CONTAINER_CLOSERS) + single(_STRING_CLOSERS) + single(_SMALL_VALUES)))
        return cls(letter=letter[0] if letter else None, in_string=single(_STRING_CLOSERS), outside=outside,
                   eos=int(tokenizer.eos_tokens[0]))


def accepts_after(matcher: "llguidance.LLMatcher", tokens: list[int], eos: int) -> bool:
    """Whether `tokens` take the grammar from the matcher's state to an accepting one (one `validate_tokens`;
    the matcher is not changed)."""
    return matcher.validate_tokens([*tokens, eos]) == len(tokens) + 1


def _mask_token(matcher: "llguidance.LLMatcher", eos: int) -> int | None:
    """From the grammar's mask: the first allowed token after which the grammar accepts, else the lowest.
    Only the mask's first _SCAN + 1 non-zero 32-token words are unpacked (each holds an allowed token, so they
    hold the lowest _SCAN + 1, EOS among them or not), not the whole vocabulary's bits."""
    words = np.frombuffer(matcher.compute_bitmask(), dtype="<u4")                      # [w] bit j: token 32i + j
    nz = np.flatnonzero(words)[:_SCAN + 1]                                             # [m] ascending
    bits = np.unpackbits(words[nz].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")   # [m, 32]
    allowed = (nz[:, None] * 32 + np.arange(32))[bits.astype(bool)]                    # ascending token ids
    allowed = allowed[allowed != eos][:_SCAN].tolist()
    if not allowed:
        return None
    return next((t for t in allowed if accepts_after(matcher, [t], eos)), allowed[0])


def closing_path(matcher: "llguidance.LLMatcher", tokenizer: "llguidance.LLTokenizer", probes: ClosingTokens,
                 limit: int, hints: Sequence[list[int]] = (), walk: bool = True) -> list[int] | None:
    """Tokens completing the grammar from the matcher's current state (at most `limit`), or None (see the
    module docstring). The matcher itself is not changed. [] when the grammar already accepts.

    hints: candidate completions taken from an earlier state (`hints_after`), shortest first. Before each
    step, the first hint that completes the grammar from where the search stands ends the path: after a
    token that replaced the old closing's first (a digit for its `0`), began it (a `"` of its `", "`) or
    needs one token more (a `.` before `0"}`), the search is a validate or one step, not the whole walk (a
    matcher copy, then a consume per step). walk=False: only the hints are tried (None when none fits)."""
    if matcher.is_accepting():
        return []
    if matcher.is_error() or limit <= 0:
        return None
    limit = min(limit, MAX_CLOSING)
    tail = _fitting_hint(matcher, hints, probes.eos, limit)
    if tail is not None or not walk:
        return tail
    work = matcher.deep_copy()
    path: list[int] = []
    while len(path) < limit:
        if path and (tail := _fitting_hint(work, hints, probes.eos, limit - len(path))) is not None:
            return path + tail
        forced = work.compute_ff_bytes()
        step = list(tokenizer.tokenize_bytes(forced)) if forced else _probe_step(work, probes)
        if not step or not work.consume_tokens(step[: limit - len(path)]):
            return None
        path += step[: limit - len(path)]
        if work.is_accepting():
            return path
    return None


def hints_after(tokenizer: "llguidance.LLTokenizer", closing: list[int], token: int) -> list[list[int]]:
    """Completions to try (`closing_path`'s hints), shortest first, after `token` was fed where `closing`
    completed the grammar: `closing[1:]`, `closing`, and, when the token's bytes begin the closing's, the
    rest re-tokenized (shortest first: a `2` after `.` is closed by `", ...`, not by the `0", ...` that
    still fits)."""
    if not closing:
        return []
    hints = [closing[1:], closing]                      # shortest first
    done = tokenizer.decode_bytes([token])
    whole = tokenizer.decode_bytes(closing)
    if done and len(whole) > len(done) and whole.startswith(done):
        hints.append(list(tokenizer.tokenize_bytes(whole[len(done):])))
        hints.sort(key=len)
    return hints


def _fitting_hint(matcher: "llguidance.LLMatcher", hints: Sequence[list[int]], eos: int, room: int) -> list[int] | None:
    """The first non-empty hint of at most `room` tokens that completes the grammar from the matcher's state."""
    for hint in hints:
        if hint and len(hint) <= room and accepts_after(matcher, hint, eos):
            return hint
    return None


def _probe_step(matcher: "llguidance.LLMatcher", probes: ClosingTokens) -> list[int]:
    in_string = probes.letter is not None and matcher.validate_tokens([probes.letter]) == 1
    for token in probes.in_string if in_string else probes.outside:
        if matcher.validate_tokens([token]) == 1:
            return [token]
    token = _mask_token(matcher, probes.eos)
    return [] if token is None else [token]
