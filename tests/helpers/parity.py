"""Our model code against a reference: transformers' teacher-forced logits, a plain full forward over our
family functions (`ReferenceRunner`), and how far 4-bit weights and cache move the logits."""
from __future__ import annotations

import torch

from engine.models.attention import attention, causal_mask
from engine.models.loader import LoadedModel, load_model
from engine.policy.policy import Policy
from helpers.greedy_runs import LogitRecorder, make_prompts, run_logits


def check_against_hf(hf, prompts, sel: LogitRecorder, atol: float = 1e-4) -> None:
    """Teacher-forced transformers logits of prompt + our tokens equal ours at every step; argmax equal."""
    with torch.inference_mode():
        for r, p in enumerate(prompts):
            ids = torch.tensor([p + sel.tokens[r][:-1]])
            ref = hf(input_ids=ids).logits[0, len(p) - 1:].float()  # [steps, v]
            mine = torch.stack(sel.logits[r])  # [steps, v]
            err = (mine - ref).abs().max().item()
            assert err < atol, f"row {r} (prompt length {len(p)}): max |logit diff| {err}"
            assert ref.argmax(-1).tolist() == sel.tokens[r], f"row {r}: greedy tokens differ"


def check_shared_prefix_against_hf(folder, hf) -> None:
    """The float32 model in `folder` matches `hf`'s logits on six prompts sharing a 12-token prefix, run as
    two GPU batches of three."""
    loaded = load_model(folder, dtype=torch.float32)
    prefix = make_prompts(1, loaded.config.vocab_size, seed=12, lo=12, hi=13)[0]
    prompts = [prefix + p for p in make_prompts(6, loaded.config.vocab_size, seed=13, lo=1, hi=12)]
    sel = run_logits(loaded, Policy(gpu_batch_size=3, num_gpu_batches=2), prompts, [6] * 6)
    check_against_hf(hf, prompts, sel)


def compressed_drift(loaded) -> float:
    """Relative change of the first step's logits (4 prompts) under 4-bit weights + 4-bit cache on the cpu with
    cpu attention, against the dense run; asserts they are finite."""
    prompts = make_prompts(4, loaded.config.vocab_size, seed=6)
    ref = run_logits(loaded, Policy(gpu_batch_size=4), prompts, [4] * 4)
    got = run_logits(loaded, Policy(gpu_batch_size=4, compress_weights=True, compress_cache=True, cache_gpu=0.0,
                                    cache_cpu=1.0, cpu_attention=True), prompts, [4] * 4)
    a, b = torch.stack([ref.logits[r][0] for r in range(4)]), torch.stack([got.logits[r][0] for r in range(4)])
    assert torch.isfinite(b).all()
    return ((b - a).norm() / a.norm()).item()


class ReferenceRunner:
    """A simple full forward over our family functions, holding all weights and a plain KV cache (tests only)."""

    def __init__(self, m: LoadedModel) -> None:
        self.m = m
        self.specs = m.family.layer_specs()
        self.w = {s.name: m.weights.get(s) for s in self.specs}
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """ids/positions [b, s]; key_valid [b, past + s] -> last-position logits [b, v]."""
        f, specs = self.m.family, self.specs
        hidden = f.embed(self.w[specs[0].name], ids, positions)  # [b, s, h]
        layers = specs[1:-1]
        new_cache = []
        for j in range(0, len(layers), 2):
            wa, wm = self.w[layers[j].name], self.w[layers[j + 1].name]
            q, k, v = f.attn_qkv(wa, hidden, positions)
            if self.cache:
                pk, pv = self.cache[j // 2]
                k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)  # [b, nkv, t, hd]
            new_cache.append((k, v))
            a = attention(q, k, v, causal_mask(key_valid, ids.shape[1]), self.m.config.attn_scale)
            hidden = f.mlp(wm, f.attn_out(wa, a, hidden))
        self.cache = new_cache
        return f.head(self.w[specs[-1].name], hidden[:, -1])  # [b, v]


def left_padded(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [b, s] with pad id 0 on the left, mask [b, s] int64)."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.zeros(len(lengths), s, dtype=torch.long)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, s - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[r, s - n:] = 1
    return ids, mask
