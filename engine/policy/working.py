"""The compute device's working memory for one GPU batch, and the row chunks that bound it (pure arithmetic).

In the policy package so the memory model (`memory`) and the runtime's executor share one formula and one
chunking rule with the arrow pointing down (runtime -> policy). Numbers of the model's code that the formula
needs (the buffers of one expert group, `ExpertBuffers`) come in as data.

Chunked prefill. A GPU batch's prefill runs each layer over chunks of rows (`row_chunks`: about
`PREFILL_CHUNK_TOKENS` tokens per chunk, whole rows), writing each chunk's output into the batch's hidden
in place; rows are independent in every layer, so a chunk is the same maths as the whole batch (positions,
masks and the cache rows it writes are the chunk's own). Rows, not prompt positions: a position chunk would
attend to the earlier chunks' keys read back from the cache, which is 4-bit when the cache is compressed,
so its tokens would differ from the unchunked prefill's; a row chunk sees exactly the keys it saw before.
Decode over a compressed cache on the device dequantizes keys/values `decode_chunk_rows` rows at a time.

Counted against the gpu budget at block start (the larger of the prefill and the decode part, plus the
staged keys/values and the logits, so the sum stays affine in the cache placement for the LP; a fixed
margin covers the allocator's rounding):
  - prefill: the batch's hidden [b, s, h] (updated in place; with a shared prefix computed once, the prefix
    [1, L, h] and the rows' own tokens [b, s - L, h], see `working_bytes`); the new keys/values of every chunk waiting
    for `store_cache` in the heads whose home is not written in place (`staged_kv_heads`); per chunk of
    c rows the live intermediates of the larger of one attention or one MLP layer (per token: normed
    input, q/k/v, attention output, output projection, residual; or the fused gate/up, activation,
    product, down output; for a sparse-MoE layer `moe_mlp_bytes`: the router, the (token, expert) pair
    indices, a shared expert, and one expert group's padded buffers, `expert_buffer_bytes`), the batch's
    token ids, positions and key validity,
    SDPA's boolean mask, and with soft-capped attention (Gemma2: no fused kernel) the explicit float scores
    and probabilities;
  - decode: the b rows' one-token intermediates and, with a compressed cache, the dense keys/values
    dequantized for one chunk of rows' attention;
  - the head's float32 logits [b, vocab] of the last position (and the selector's copy of them).
"""
from __future__ import annotations

from typing import Any

from engine.policy.dtypes import element_size
from engine.policy.layout import ExpertBuffers, ModelConfig
from engine.policy.placement import split_ranges

_MARGIN = 16 << 20
PREFILL_CHUNK_TOKENS = 4096          # tokens per prefill row chunk (at least one whole row)
DECODE_CHUNK_BYTES = 256 << 20       # dense keys + values dequantized per decode chunk of rows


def chunk_rows(b: int, s: int, chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> int:
    """Rows per prefill chunk over b rows of s tokens each (the first chunk's, the largest): max(1, chunk_tokens
    // s). s is what each row computes: its own tokens past a shared prefix computed once, else its prompt."""
    return max(1, min(b, chunk_tokens // max(1, s)))


def rows_per_pass(rows: int, decode_steps: int) -> int:
    """Rows of the next block an ahead prefill (`engine.runtime.ahead`) carries on each of the running block's
    `decode_steps` decode steps, so the whole prefill ends within them."""
    return -(-rows // max(1, decode_steps))


def row_chunks(b: int, s: int, chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> list[tuple[int, int]]:
    """The [r0, r1) row ranges of a prefill over b rows of s tokens each (as `chunk_rows`): `chunk_rows` rows each."""
    rows = chunk_rows(b, s, chunk_tokens)
    return [(r0, min(b, r0 + rows)) for r0 in range(0, b, rows)]


def decode_chunk_rows(b: int, num_kv_heads: int, length: int, head_dim: int, dtype: Any,
                      chunk_bytes: int = DECODE_CHUNK_BYTES) -> int:
    """Rows per chunk when decode dequantizes a compressed cache [b, num_kv_heads, length, head_dim] on the
    device: as many as keep the dense keys + values of a chunk within `chunk_bytes` (at least one)."""
    row = 2 * num_kv_heads * length * head_dim * element_size(dtype)
    return max(1, min(b, chunk_bytes // max(1, row)))


def staged_kv_heads(num_kv_heads: int, cache_gpu: float, cache_cpu: float, device_type: str,
                    compressed_cache: bool) -> int:
    """KV heads whose prefill keys/values wait in device memory for `store_cache` (the homes not written
    in place: every non-gpu home, except a dense cpu home on a CPU-only machine, which is compute memory)."""
    n = 0
    for tier, h0, h1 in split_ranges(num_kv_heads, cache_gpu, cache_cpu):
        in_place = tier == "gpu" or (tier == "cpu" and device_type == "cpu" and not compressed_cache)
        n += 0 if in_place else h1 - h0
    return n


def expert_buffer_bytes(c: ModelConfig, tokens: int, element_size: int, experts: ExpertBuffers) -> int:
    """The most bytes one expert group of `moe_experts` holds for `tokens` tokens, over every routing: a
    group of several experts stays within `experts.group_bytes`, a single expert holds its count (at most
    `tokens`) padded rows, and no group has more than E experts of `tokens` rows (on an accelerator a group
    spans experts without tokens too); `experts.row_elements` elements per padded row. On a CPU device (one
    expert per group, `CPU_GROUP_BYTES`) a group holds at most `tokens` rows: within this bound, not at it."""
    slot = experts.row_elements * element_size
    widest = c.num_local_experts * tokens
    return min(widest, max(experts.group_bytes // slot, tokens)) * slot


def moe_mlp_bytes(c: ModelConfig, tokens: int, element_size: int, experts: ExpertBuffers) -> int:
    """Live bytes of one sparse-MoE layer over `tokens` tokens: per token the normed input, the routed output,
    the residual sum and a shared expert's fused gate/up, activation and product [4 h + 4 si], and the k routed
    pairs' outputs before their sum (`experts_grouped_mm`, [k h]); the router's
    logits and float32 probabilities [E]; per (token, expert) pair the sorted experts and order, token, rank
    and index tensors (int64) and the float32 routing weight; plus one expert group (`expert_buffer_bytes`)."""
    e, h, k = element_size, c.hidden_size, c.num_experts_per_tok
    shared = c.n_shared_experts * c.expert_intermediate_size or c.shared_expert_intermediate_size
    per_token = (4 * h + k * h + 4 * shared) * e + c.num_local_experts * (e + 8) + k * (5 * 8 + 2 * 4)
    return tokens * per_token + expert_buffer_bytes(c, tokens, e, experts)


def working_bytes(c: ModelConfig, b: int, s: int, length: int, dtype: Any, compressed_cache: bool,
                  staged_heads: int = 0, chunk_tokens: int = PREFILL_CHUNK_TOKENS,
                  decode_chunk_bytes: int = DECODE_CHUNK_BYTES, prefix_len: int = 0,
                  experts: ExpertBuffers | None = None) -> int:
    """Bytes of device working memory for b rows of s prompt tokens over a cache of `length` positions;
    `staged_heads` as `staged_kv_heads` gives; `chunk_tokens` / `decode_chunk_bytes` the chunk sizes of the
    prefill (`row_chunks`, cut by the tokens each row computes: s, or s - L past a prefix) and of decode over a compressed cache
    (`decode_chunk_rows`); `prefix_len` the leading tokens the batch computes once (its `GpuBatch.prefix_len`).
    With a prefix L the prefill holds the prefix [1, L, h] and the rows' own tokens [b, s - L, h], computes
    the prefix's layer (L tokens' intermediates and its causal mask) before the row chunks, keeps the
    prefix's keys/values [1, nkv, L, hd] for them, and a chunk's intermediates span its rows' s - L own
    tokens plus the prefix keys/values concatenated to theirs [c, nkv, s, hd] and the masks [c, 1, s - L, s].
    Grouped-query attention adds its fold (`attention._folded_sdpa`: q's copy and the g-fold mask). A sparse-MoE
    model's MoE layers need its `experts` (`ExpertBuffers`)."""
    if c.is_moe and experts is None:
        raise ValueError("working_bytes: a sparse-MoE model needs its expert group buffers (ExpertBuffers, "
                         "engine.runtime.layout.expert_buffers)")
    e = element_size(dtype)
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    attn = (4 * c.hidden_size + 3 * qkv + 2 * c.num_attention_heads * c.head_dim) * e
    dense = any(not c.is_moe_layer(j) for j in range(c.num_hidden_layers))
    mlp = (4 * c.hidden_size + 4 * c.intermediate_size) * e if dense else 0    # fused gate_up [2i], act, product

    def layer(tokens: int) -> int:
        """The larger of one attention, one dense MLP and one sparse-MoE layer over `tokens` tokens."""
        moe = moe_mlp_bytes(c, tokens, e, experts) if c.is_moe else 0
        return max(tokens * max(attn, mlp), moe)

    soft = c.attn_logit_softcapping is not None
    L, own = prefix_len, s - prefix_len                                                  # own tokens per row
    cb = chunk_rows(b, own, chunk_tokens)                                                # rows per chunk
    g = c.num_attention_heads // c.num_key_value_heads
    # grouped-query attention on CUDA folds the groups into the query length (`attention._folded_sdpa`): a
    # copy of q (none where RoPE's kernel left it contiguous: counted regardless) and the mask repeated g
    # times, as bool and as the kernel's additive bias (2 bytes)
    fold = (cb * own * c.num_attention_heads * c.head_dim * e + 3 * g * cb * own * length) if g > 1 else 0
    hidden = (b * own + L) * c.hidden_size * e                                           # [b, s-L, h] (+ [1, L, h])
    staged = 2 * b * staged_heads * s * c.head_dim * e                                   # k, v [b, heads, s, hd]
    ids = (b * own + L) * 8 * 2 + b * length                                             # ids, positions, key_valid
    scores = 3 * cb * c.num_attention_heads * own * length * 4 if soft else 0
    if L:
        kv_cat = 2 * cb * c.num_key_value_heads * s * c.head_dim * e                     # k, v [c, nkv, s, hd]
        prefix_kv = 2 * L * c.num_key_value_heads * c.head_dim * e                       # [1, nkv, L, hd]
        prefix_fold = (L * c.num_attention_heads * c.head_dim * e + 3 * g * L * L) if g > 1 else 0
        prefix_layer = layer(L) + L * L + (3 * c.num_attention_heads * L * L * 4 if soft else 0) + prefix_fold
        chunk = layer(cb * own) + kv_cat + 2 * cb * own * length + scores + fold
        prefill = hidden + ids + prefix_kv + max(prefix_layer, chunk)
    else:
        prefill = hidden + ids + layer(cb * s) + cb * s * length + scores + fold
    cd = decode_chunk_rows(b, c.num_key_value_heads, length, c.head_dim, dtype, decode_chunk_bytes)
    dense_cache = 4 * cd * c.num_key_value_heads * length * c.head_dim * e if compressed_cache else 0
    decode_scores = 3 * b * c.num_attention_heads * length * 4 if soft else 0
    decode = layer(b) + b * length + dense_cache + decode_scores
    logits = b * c.vocab_size * 4 * 2
    return max(prefill, decode) + staged + logits + _MARGIN
