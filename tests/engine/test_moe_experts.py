"""`moe_experts` (grouped, batched launches) against a plain per-expert loop: equal within fp32
tolerance for every routing shape (experts without tokens, one token, uneven counts, every token on one
expert), padded rows never reaching the output, the grouped path and the one-expert-per-group fallback
(a tiny cap) agreeing, the group plan (`expert_groups`) as documented, the peak bytes as the memory model
counts them, and (CUDA) one host sync per call; the sync-free grouped-matmul path (`experts_grouped_mm`) against
the loop on the CPU for every routing and chunking, and on CUDA sm90+ in bfloat16 with no host sync."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers import linear
from engine.models import moe
from engine.models.moe import (EXPERT_GROUP_BYTES, expert_groups, expert_slot_bytes, experts_grouped_mm,
                               grouped_mm_self_check, moe_experts)
from helpers.live_bytes import LiveBytes
from helpers.skips import requires_cuda

N, H, I, E, K = 37, 16, 24, 6, 2


def per_expert_loop(x, top_w, top_e, w1, w2, w3, act):
    """The reference: each expert's tokens selected with torch.where, three linears, weighted index_add."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = torch.where(top_e == e)
        y = linear(act(linear(x[token], w1[e])) * linear(x[token], w3[e]), w2[e])    # [m, h]
        out.index_add_(0, token, (y * top_w[token, slot, None]).to(out.dtype))
    return out


def _weights(g):
    return (torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g),
            torch.randn(E, I, H, generator=g))                                      # w1, w2, w3


def _routing(kind: str, g) -> torch.Tensor:
    """top_e [N, K] of one routing shape."""
    if kind == "uneven":           # expert E-1 gets no token, the others uneven counts
        return torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(N)])
    if kind == "one_expert":       # every token's first choice is expert 2 (count N), second spread over 0, 1, 3
        second = torch.tensor([0, 1, 3])[torch.randint(0, 3, (N,), generator=g)]
        return torch.stack((torch.full((N,), 2), second), dim=1)
    if kind == "single_tokens":    # experts 0, 1 and 5 get one token each, 3 and 4 nearly all, 2 none
        top_e = torch.full((N, K), 3)
        top_e[:, 1] = 4
        top_e[0] = torch.tensor([0, 1])
        top_e[1] = torch.tensor([5, 3])
        return top_e
    raise ValueError(kind)


ROUTINGS = ["uneven", "one_expert", "single_tokens"]
CAPS = {"accelerator": EXPERT_GROUP_BYTES, "mid": 6 * expert_slot_bytes(H, I, 4), "one_per_group": 1,
        "cpu_default": None}


@pytest.mark.parametrize("cap", list(CAPS))
@pytest.mark.parametrize("routing", ROUTINGS)
def test_moe_experts_equal_the_per_expert_loop(routing, cap):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=g)
    w1, w2, w3 = _weights(g)
    top_e, top_w = _routing(routing, g), torch.rand(N, K, generator=g)
    want = per_expert_loop(x, top_w, top_e, w1, w2, w3, F.silu)
    got = moe_experts(x, top_w, top_e, w1, w2, w3, F.silu, group_bytes=CAPS[cap])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    spanning = moe_experts(x, top_w, top_e, w1, w2, w3, F.silu, group_bytes=CAPS[cap], gaps=True)
    torch.testing.assert_close(spanning, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_padded_rows_never_reach_the_output(routing, gaps):
    """With act(0) = 1 a padded (zero) input row gives a non-zero expert output: any padded row added back
    would change the result, and a token routed nowhere must stay exactly zero."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, H, generator=g)
    w1, w2, w3 = _weights(g)
    top_e, top_w = _routing(routing, g), torch.rand(N, K, generator=g)

    def act(t):
        return F.silu(t) + 1.0

    want = per_expert_loop(x, top_w, top_e, w1, w2, w3, act)
    got = moe_experts(x, top_w, top_e, w1, w2, w3, act, group_bytes=EXPERT_GROUP_BYTES, gaps=gaps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    top_w[5:] = 0.0                                  # tokens 5.. weigh nothing: exactly zero, padding or not
    got = moe_experts(x, top_w, top_e, w1, w2, w3, act, group_bytes=EXPERT_GROUP_BYTES, gaps=gaps)
    assert torch.equal(got[5:], torch.zeros(N - 5, H))


def test_grouped_and_one_expert_fallback_agree_in_bfloat16():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, H, generator=g).bfloat16()
    w1, w2, w3 = (w.bfloat16() for w in _weights(g))
    top_e, top_w = _routing("uneven", g), torch.rand(N, K, generator=g)
    grouped = moe_experts(x, top_w, top_e, w1, w2, w3, F.silu, group_bytes=EXPERT_GROUP_BYTES)
    fallback = moe_experts(x, top_w, top_e, w1, w2, w3, F.silu, group_bytes=1)
    assert grouped.dtype == torch.bfloat16
    torch.testing.assert_close(grouped.float(), fallback.float(), rtol=2e-2, atol=2e-2 * fallback.abs().max().item())


def test_no_tokens_give_zeros():
    w1, w2, w3 = _weights(torch.Generator().manual_seed(3))
    x = torch.empty(0, H)
    out = moe_experts(x, torch.empty(0, K), torch.empty(0, K, dtype=torch.int64), w1, w2, w3, F.silu)
    assert out.shape == (0, H)


@pytest.mark.parametrize("counts,cap,want", [
    ([3, 0, 5, 1, 0, 2], 100, [(0, 1, 3), (2, 4, 5), (5, 6, 2)]),          # zero-count experts split runs
    ([2, 2, 2, 2], 100, [(0, 4, 2)]),                                       # all hit, under the cap: one group
    ([2, 2, 2, 2], 20, [(0, 2, 2), (2, 4, 2)]),                             # the cap splits a run
    ([1, 9, 1], 50, [(0, 1, 1), (1, 2, 9), (2, 3, 1)]),                     # padding to 9 would pass the cap
    ([30, 1], 50, [(0, 1, 30), (1, 2, 1)]),                                 # over the cap alone: a group of one
    ([0, 0], 100, []),
])
def test_expert_groups(counts, cap, want):
    assert expert_groups(counts, slot_bytes=5, group_bytes=cap) == want


@pytest.mark.parametrize("counts,cap,want", [
    ([3, 0, 5, 1, 0, 2], 200, [(0, 6, 5)]),                                # one group through the idle experts
    ([0, 3, 0, 0, 1, 0], 200, [(1, 5, 3)]),                                # no idle expert at either end
    ([3, 0, 5, 1, 0, 2], 80, [(0, 3, 5), (3, 6, 2)]),                      # the cap still splits: 4 x 5 x 5 > 80
    ([1, 0, 0, 0, 0, 0, 0, 1], 30, [(0, 1, 1), (7, 8, 1)]),                # 8 x 1 x 5 = 40 would pass the cap
])
def test_expert_groups_with_gaps(counts, cap, want):
    """On an accelerator a group spans experts without tokens (their rows all padding)."""
    assert expert_groups(counts, slot_bytes=5, group_bytes=cap, gaps=True) == want


def _config():
    from dataclasses import replace

    from engine.models.hf_config import config_from_hf
    from engine.models.presets import PRESETS

    return replace(config_from_hf(PRESETS["tiny-mixtral"]), hidden_size=H, intermediate_size=I,
                   num_local_experts=E, num_experts_per_tok=K)


@pytest.mark.parametrize("cap_rows", [None, 3 * N])
def test_expert_buffers_reach_and_stay_within_the_memory_model(cap_rows):
    """The routing that pads most (every expert hit, expert 0 by every token): the peak bytes `moe_experts`
    allocates are at least the group bound `expert_buffer_bytes` (the bound is reached, so it is not loose)
    and at most `moe_mlp_bytes` (the bound plus the per-token terms); with a cap of 3N padded rows the
    groups split and the bound follows the cap."""
    from engine.policy.layout import ExpertBuffers
    from engine.policy.working import expert_buffer_bytes, moe_mlp_bytes

    g = torch.Generator().manual_seed(4)
    x = torch.randn(N, H, generator=g)
    w1, w2, w3 = _weights(g)
    top_e = torch.stack((torch.zeros(N, dtype=torch.int64), 1 + torch.arange(N) % (E - 1)), dim=1)
    top_w = torch.rand(N, K, generator=g)
    cap = (1 << 30) if cap_rows is None else cap_rows * expert_slot_bytes(H, I, 4)
    with LiveBytes() as live:
        moe_experts(x, top_w, top_e, w1, w2, w3, F.silu, group_bytes=cap)
    experts = ExpertBuffers(expert_slot_bytes(H, I, 1), cap)
    buffers = expert_buffer_bytes(_config(), N, 4, experts)
    assert buffers == (E * N if cap_rows is None else cap_rows) * expert_slot_bytes(H, I, 4)
    inputs = {t.untyped_storage().data_ptr() for t in (x, top_w, top_e, w1, w2, w3)}
    assert buffers <= live.peak(inputs) <= moe_mlp_bytes(_config(), N, 4, experts)


@pytest.mark.parametrize("chunk_rows", [1, 7, 2 * N, None])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_grouped_mm_path_equals_the_per_expert_loop(routing, chunk_rows):
    """`experts_grouped_mm` on the CPU (torch's reference loop of `_grouped_mm`): the loop's result within fp32
    tolerance for every routing, in chunks of one pair, of 7 (chunks that split an expert's pairs), of every
    pair, and at the default cap."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(N, H, generator=g)
    w1, w2, w3 = _weights(g)
    top_e, top_w = _routing(routing, g), torch.rand(N, K, generator=g)
    cap = EXPERT_GROUP_BYTES if chunk_rows is None else chunk_rows * expert_slot_bytes(H, I, 4)
    got = experts_grouped_mm(x, top_w, top_e, w1, w2, w3, F.silu, cap)
    want = per_expert_loop(x, top_w, top_e, w1, w2, w3, F.silu)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_grouped_mm_self_check_passes_on_the_cpu_and_names_a_mismatch(monkeypatch):
    assert grouped_mm_self_check(torch.device("cpu")) and grouped_mm_self_check(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(moe, "experts_grouped_mm", lambda x, *a: torch.zeros_like(x))
    with pytest.raises(RuntimeError, match="experts_grouped_mm differs from the grouped bmm"):
        grouped_mm_self_check(torch.device("cpu"))


def test_the_cpu_keeps_the_grouped_bmm():
    """The sync-free path is for bfloat16 on CUDA sm90+ only: a CPU tensor of any dtype takes the bmm groups."""
    w1 = torch.zeros(4, 8, 8, dtype=torch.bfloat16)
    assert not moe._sync_free(torch.zeros(2, 8, dtype=torch.bfloat16), w1)
    assert not moe._sync_free(torch.zeros(2, 8), w1.float())


@pytest.mark.parametrize("cap_rows", [None, 3 * N])
def test_grouped_mm_buffers_stay_within_the_memory_model(cap_rows):
    """The sync-free path's peak bytes stay within `moe_mlp_bytes` (its chunks hold at most the cap's rows, no
    padding), for the routing that pads the bmm groups most."""
    from engine.policy.layout import ExpertBuffers
    from engine.policy.working import moe_mlp_bytes

    g = torch.Generator().manual_seed(4)
    x = torch.randn(N, H, generator=g)
    w1, w2, w3 = _weights(g)
    top_e = torch.stack((torch.zeros(N, dtype=torch.int64), 1 + torch.arange(N) % (E - 1)), dim=1)
    top_w = torch.rand(N, K, generator=g)
    cap = EXPERT_GROUP_BYTES if cap_rows is None else cap_rows * expert_slot_bytes(H, I, 4)
    with LiveBytes() as live:
        experts_grouped_mm(x, top_w, top_e, w1, w2, w3, F.silu, cap)
    inputs = {t.untyped_storage().data_ptr() for t in (x, top_w, top_e, w1, w2, w3)}
    assert 0 < live.peak(inputs) <= moe_mlp_bytes(_config(), N, 4, ExpertBuffers(expert_slot_bytes(H, I, 1), cap))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_on_cuda_match_the_loop_with_one_host_sync(dtype):
    """On the GPU: the loop's result (fp32 within 1e-5 of the largest value, bf16 within 2e-2) and exactly one
    synchronizing call (the per-expert counts), grouped or one expert per group; none for bfloat16 on sm90+,
    where the grouped matmuls run (after their first-use check)."""
    sync_free = dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (9, 0)
    if sync_free:
        assert moe._grouped_mm_ready(torch.cuda.current_device())      # the check passes (and syncs) first
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, H, generator=g)
    w1, w2, w3 = _weights(g)
    top_e, top_w = _routing("uneven", g), torch.rand(N, K, generator=g)
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    want = per_expert_loop(x.float(), top_w, top_e, w1.float(), w2.float(), w3.float(), F.silu)
    cuda = [t.cuda() for t in (x, top_w, top_e, w1, w2, w3)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for cap in ({}, {"group_bytes": 1}):                  # the accelerator's default, one expert per group
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = moe_experts(*cuda, F.silu, **cap)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert sum("synchroniz" in str(w.message) for w in caught) == (0 if sync_free else 1)
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_the_grouped_path_gives_the_executors_tokens(tiny_checkpoints, monkeypatch):
    """Through the executor on the CPU: the accelerator's grouping (forced) gives the greedy tokens of the
    CPU's default, one expert per group."""
    from engine.models.loader import load_model
    from engine.policy.policy import Policy
    from helpers.greedy_runs import make_prompts, run_policy

    loaded = load_model(tiny_checkpoints["mixtral"], dtype=torch.float32)
    prompts, max_new = make_prompts(9, loaded.config.vocab_size, seed=7), [6, 9, 3, 9, 7, 9, 5, 9, 8]
    policy = Policy(gpu_batch_size=9, num_gpu_batches=1)
    want = run_policy(loaded, policy, prompts, max_new)[0]
    monkeypatch.setattr(moe, "CPU_GROUP_BYTES", EXPERT_GROUP_BYTES)
    assert run_policy(loaded, policy, prompts, max_new)[0] == want
