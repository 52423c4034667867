"""Decoding: what a request asks for and how tokens are chosen, encoded and decoded (no placement, no policy).

`params` (SamplingParams, Completion), `sampling` (greedy/sampled picks, per-row keys), `constrain` and
`closing` (llguidance grammar constraints and their closing paths), `prompts` (prompt encoding, data as
data), `tokenizer` (tokenizer.json, incremental detokenizer), `chat` (sandboxed chat templates), `blocks`
(rows sorted into blocks by length) and `decoder` (`BlockDecoder`: the runtime's `TokenSelector` for one
block). Used by the facade and, through the selector protocol, by the runtime; imports no other engine layer.
"""
