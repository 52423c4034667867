"""How sure the model was of a constrained output: one number per row, folded in the decode loop.

Per token, the quantity is the token's probability under the constrained distribution at temperature 1:
q_t = softmax(masked logits_t)[token_t] = p(token_t) / sum of p(a) over the tokens a the grammar allows at
step t, with p = softmax(logits_t) the model's own distribution (no temperature, top-k or top-p: those change
which token is drawn, never its confidence). A token the grammar forces (the only one allowed) has q_t = 1.

Per row (`Completion.confidence`, in [0, 1]):
- choices: the product of q_t over the emitted tokens (an EOS token chosen where an option could also go on
  included), i.e. the probability that decoding under the constraint at temperature 1 emits exactly this
  option along this path. It is the chosen path's share of the masked probability mass, computed from the
  one forward per token that decoding runs anyway: the other options' own token probabilities would need
  forward passes of their own, so they are not computed. When the options differ in their first token and
  their later tokens are forced, this equals p(option) renormalised over the options.
- json_schema / regex: the minimum of q_t over the emitted tokens: the least sure decision the model made.
  Tokens the grammar forces (keys, braces, quotes) have q_t = 1 and never lower it; a product or a mean
  would let long forced stretches hide one coin-flip value token.
- unconstrained rows, and rows that did not finish their constraint (finish_reason other than "stop"):
  None.
"""
from __future__ import annotations

import math
from typing import Literal

from engine.decoding.params import SamplingParams

Fold = Literal["product", "min"]


def fold_for(params: SamplingParams) -> Fold | None:
    """How a row's per-token log-probabilities fold into its confidence (None: unconstrained, no confidence)."""
    if params.choices is not None:
        return "product"
    if params.json_schema is not None or params.regex is not None:
        return "min"
    return None


def fold(how: Fold, acc: float, logprob: float) -> float:
    """The running fold (a log-probability, 0.0 before the first token) after one more token's log q_t."""
    return acc + logprob if how == "product" else min(acc, logprob)


def confidence(acc: float) -> float | None:
    """The confidence of a folded log-probability: exp(acc) in [0, 1]; None when it is not a number (a row
    whose every token was masked, which a grammar never asks for)."""
    return None if math.isnan(acc) else math.exp(acc)
