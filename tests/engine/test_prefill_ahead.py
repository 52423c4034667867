"""The ahead prefill on the CPU (fp32): `Policy(prefill_ahead=True)` runs block n + 1's prefill in row chunks on
block n's decode weight passes (`engine.runtime.ahead`), its cache's gpu share parked on the host until the
switch. Whatever the placement, the tokens must be those of the block-by-block run, block by block; the
blocks it cannot run ahead (the first, after a block without a decode step, budgets too small for its working
memory or parked homes) run their own prefill, with the same tokens. Also: the schedules'
`first` (a block whose prefill ran ahead starts at step 1) and the executor's teardown after ahead blocks."""
from __future__ import annotations

from collections import Counter

import gc
import weakref

import pytest
import torch

from engine.models.loader import load_model
from engine.policy.policy import Policy
from engine.policy.prefix import MIN_SHARED_PREFIX
from engine.policy.weight_slots import WeightSlots
from engine.runtime.batch import shared_prefix_len
from engine.runtime.executor import Executor
from engine.runtime.moe_schedule import moe_block_schedule
from engine.runtime.schedule import Action, block_schedule, slots
from helpers.greedy_runs import GreedyRecorder, make_prompts
from helpers.schedule_checks import assert_weight_loads_wait_for_computes
from helpers.tiny_checkpoints import TINY_CONFIGS

KINDS = ["llama", "opt", "mixtral"]
BASE = dict(gpu_batch_size=3, num_gpu_batches=2)
MATRIX = {
    "in_memory": dict(),
    "cache_split": dict(cache_gpu=0.5, cache_cpu=0.5),
    "cache_cpu_attention": dict(cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True),
    "w_cpu_4bit_cache_split": dict(w_gpu=0.0, w_cpu=1.0, compress_cache=True, cache_gpu=0.5, cache_cpu=0.5),
    "act_partly_cpu": dict(act_gpu=0.25, act_cpu=0.75),
    "compress_weights": dict(compress_weights=True),
}
MAX_NEW = [5, 9, 3, 9, 7, 2]


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    """kind -> the loaded tiny model (fp32), shared by this module's tests."""
    return {kind: load_model(tiny_checkpoints[kind], dtype=torch.float32) for kind in KINDS}


class Trace:
    """Which block `generate_blocks` is running (`block`, advanced at each yield) and the last compute action
    the `on_action` hook saw; `computes[n]` the steps of block n's compute actions."""

    def __init__(self) -> None:
        self.block = 0
        self.last = None
        self.computes: dict[int, list[int]] = {}

    def __call__(self, action) -> None:
        if action.verb == "compute":
            self.last = action
            self.computes.setdefault(self.block, []).append(action.i)


class TracedRecorder(GreedyRecorder):
    """GreedyRecorder that also notes, per call, (block running, step of the last compute action seen)."""

    def __init__(self, trace: Trace, stop_ids=()):
        super().__init__(stop_ids)
        self.trace, self.when = trace, []

    def __call__(self, rows, logits):
        last = self.trace.last
        self.when.append((self.trace.block, None if last is None else last.i))
        return super().__call__(rows, logits)


def run_blocks(loaded, policy: Policy, blocks, stops=None, **kw):
    """Run `blocks` ((prompts, max_new) each) through one executor's `generate_blocks`. Returns (tokens per
    block, each block's `prefill_ahead` flag, each block's `steps`, the `Trace`, the selectors,
    `memory_report()` at the end)."""
    trace = Trace()
    sels = [TracedRecorder(trace, stops[n] if stops else ()) for n in range(len(blocks))]
    ex = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.float32, **kw)
    flags, steps = [], []
    try:
        ex.on_action = trace
        for n in ex.generate_blocks([(p, m, s) for (p, m), s in zip(blocks, sels)]):
            assert n == len(flags)
            flags.append(ex.stats["prefill_ahead"])
            steps.append(ex.stats["steps"])
            trace.block = n + 1
        report = ex.memory_report()
    finally:
        ex.close()
    return [s.tokens for s in sels], flags, steps, trace, sels, report


def both(loaded, base: dict, blocks, stops=None, **kw):
    """(reference run without the ahead prefill, run with it), as `run_blocks` returns them."""
    ref = run_blocks(loaded, Policy(**base), blocks, stops, **kw)
    got = run_blocks(loaded, Policy(**base, prefill_ahead=True), blocks, stops, **kw)
    assert ref[1] == [0.0] * len(blocks)
    return ref, got


# ---- 1. the policy matrix ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MATRIX))
@pytest.mark.parametrize("kind", KINDS)
def test_ahead_matches_block_by_block(models, kind, name):
    loaded = models[kind]
    V = loaded.config.vocab_size
    blocks = [(make_prompts(6, V, seed=s), MAX_NEW) for s in (1, 2, 3)]
    ref, got = both(loaded, {**BASE, **MATRIX[name]}, blocks)
    assert got[1] == [0.0, 1.0, 1.0]
    for n in range(3):
        assert got[0][n] == ref[0][n], f"block {n}"
        assert [len(got[0][n][r]) for r in range(6)] == MAX_NEW
    assert got[2] == ref[2] == [9, 9, 9]                       # a ready block's prefill counts as its step 0


# ---- 2. a block that ends early ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_block_ending_early_keeps_carrying_the_passes(models, kind):
    """Block 0's rows all stop within two tokens of its 12: its decode steps go on, with no live rows, only
    as long as block 1's passes need weights (one row a pass: 6 passes on steps 1..6), then it ends."""
    loaded = models[kind]
    V = loaded.config.vocab_size
    blocks = [(make_prompts(6, V, seed=1), [12] * 6), (make_prompts(6, V, seed=2), [4] * 6)]
    plain = run_blocks(loaded, Policy(**BASE), blocks)[0]
    stop = {plain[0][r][1] for r in range(6)}                 # every row of block 0 stops at its 2nd token or before
    ref, got = both(loaded, BASE, blocks, stops=[tuple(stop), ()])
    assert got[0] == ref[0] and got[1] == [0.0, 1.0]
    assert max(len(t) for t in got[0][0].values()) <= 2 and got[2][0] <= 2
    trace, sel1 = got[3], got[4][1]
    firsts = [w for w in sel1.when if w[0] == 0]               # block 1's first tokens, picked while block 0 ran
    assert len(firsts) == 6 and {i for _, i in firsts} == set(range(1, 7))
    assert max(trace.computes[0]) == 6                          # not all 11 decode steps: it stops when done


# ---- 3. rows ending at their first token, a short next block ---------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_rows_ending_at_first_token_and_short_blocks(models, kind):
    """Block 1: rows with max_new_tokens 1 (GPU batch 1 entirely: it is done at the switch); block 2: 4 rows
    (GPU batches of 3 and 1); block 3: 2 rows (one GPU batch). Equal tokens and lengths."""
    loaded = models[kind]
    V = loaded.config.vocab_size
    max_new = [MAX_NEW, [1, 4, 1, 1, 1, 1], [3, 1, 5, 2], [4, 6]]
    blocks = [(make_prompts(len(m), V, seed=10 + n), m) for n, m in enumerate(max_new)]
    ref, got = both(loaded, {**BASE, "cache_gpu": 0.5, "cache_cpu": 0.5}, blocks)
    assert got[1] == [0.0, 1.0, 1.0, 1.0]
    assert got[0] == ref[0]
    for n, m in enumerate(max_new):
        assert [len(got[0][n][r]) for r in range(len(m))] == m, f"block {n}"


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_ahead_rows_stopped_by_the_selector_at_their_first_token(models, kind):
    """Block 1's selector ends every row at the first token its ahead pass picks (max_new_tokens 5): block 1
    has nothing left to decode, yet block 2 still runs ahead on block 1's (empty) decode steps."""
    loaded = models[kind]
    V = loaded.config.vocab_size
    blocks = [(make_prompts(6, V, seed=s), MAX_NEW if s != 2 else [5] * 6) for s in (1, 2, 3)]
    plain = run_blocks(loaded, Policy(**BASE), blocks)[0]
    stop = tuple({plain[1][r][0] for r in range(6)})
    ref, got = both(loaded, BASE, blocks, stops=[(), stop, ()])
    assert got[1] == [0.0, 1.0, 1.0]
    assert got[0] == ref[0]
    assert [len(got[0][1][r]) for r in range(6)] == [1] * 6


# ---- 4. fallbacks ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_new,flags", [
    ([[1] * 6, MAX_NEW, MAX_NEW], [0.0, 0.0, 1.0]),              # block 0 has no decode step
    ([MAX_NEW, [1] * 6, MAX_NEW, MAX_NEW], [0.0, 1.0, 0.0, 1.0]),  # a ready block without a decode step
])
@pytest.mark.parametrize("kind", KINDS)
def test_no_decode_step_runs_the_next_prefill_itself(models, kind, max_new, flags):
    loaded = models[kind]
    V = loaded.config.vocab_size
    blocks = [(make_prompts(6, V, seed=20 + n), m) for n, m in enumerate(max_new)]
    ref, got = both(loaded, BASE, blocks)
    assert got[1] == flags
    assert got[0] == ref[0]


def prefixed(V: int, seed: int, prefix_len: int, n: int = 6) -> list[list[int]]:
    """`n` prompts sharing their first `prefix_len` tokens, then 1-7 of their own."""
    prefix = make_prompts(1, V, seed=seed, lo=prefix_len, hi=prefix_len + 1)[0]
    return [prefix + p for p in make_prompts(n, V, seed=seed + 1, lo=1, hi=8)]


PREFIX_MATRIX = {name: MATRIX[name] for name in ("in_memory", "cache_split", "cache_cpu_attention",
                                                  "w_cpu_4bit_cache_split", "act_partly_cpu")}


@pytest.mark.parametrize("name", list(PREFIX_MATRIX))
@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_blocks_run_ahead(models, kind, name):
    """Blocks whose GPU batches share 40 or 48 leading tokens (each batch computes them once) run their
    prefill ahead like the others: the prefix in the pass of the batch's first rows, every later pass's rows
    attending to the keys/values it kept (one row a pass here: 6 passes over 8 decode steps). A prefix block
    after a plain one, a longer prefix after a shorter (its buffers grow), a plain block after a prefix one:
    every block's tokens are the block-by-block run's."""
    loaded = models[kind]
    V = loaded.config.vocab_size
    assert 40 >= MIN_SHARED_PREFIX
    blocks = [(make_prompts(6, V, seed=32), MAX_NEW), (prefixed(V, 40, 40), MAX_NEW), (prefixed(V, 50, 48), MAX_NEW),
              (make_prompts(6, V, seed=34), MAX_NEW), (prefixed(V, 60, 40), [4] * 6)]
    for prompts, _ in blocks[1:3]:
        for k in range(2):                                      # each GPU batch's rows share the prefix
            assert shared_prefix_len(prompts[3 * k:3 * k + 3]) >= 40
    ref, got = both(loaded, {**BASE, **PREFIX_MATRIX[name]}, blocks)
    assert got[1] == [0.0, 1.0, 1.0, 1.0, 1.0]
    for n in range(5):
        assert got[0][n] == ref[0][n], f"block {n}"


@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_ahead_with_a_4bit_cache_holds_the_prefix_once(models, kind):
    """A 4-bit cache holds a shared prefix once even on the CPU (`prefix_held_once`): the ahead prefill keeps
    it in the parked home's own prefix and the switch moves it into the block's; tokens as block by block."""
    loaded = models[kind]
    V = loaded.config.vocab_size
    blocks = [(prefixed(V, 70, 44), MAX_NEW), (prefixed(V, 72, 40), MAX_NEW), (prefixed(V, 74, 52), MAX_NEW)]
    ref, got = both(loaded, {**BASE, "cache_gpu": 0.5, "cache_cpu": 0.5, "compress_cache": True}, blocks)
    assert got[1] == [0.0, 1.0, 1.0]
    assert got[0] == ref[0]


@pytest.mark.parametrize("tier", ["gpu", "cpu"])
@pytest.mark.parametrize("kind", KINDS)
def test_budget_too_small_for_the_ahead_prefill_falls_back(models, kind, tier):
    """A budget just above the block-by-block run's peak: the ahead working memory (gpu) or the parked and
    alternate host homes (cpu) do not fit, so every block runs its own prefill, within the budget."""
    loaded = models[kind]
    V = loaded.config.vocab_size
    base = {**BASE, "cache_gpu": 0.5, "cache_cpu": 0.5}
    blocks = [(make_prompts(6, V, seed=s), MAX_NEW) for s in (1, 2, 3)]
    ref, free = both(loaded, base, blocks)
    limit = ref[5][tier]["peak"] + 256
    assert free[1] == [0.0, 1.0, 1.0] and free[5][tier]["peak"] > limit     # unlimited, the ahead run needs more
    got = run_blocks(loaded, Policy(**base, prefill_ahead=True), blocks, **{f"{tier}_memory": limit})
    assert got[1] == [0.0, 0.0, 0.0]
    assert got[0] == ref[0]
    assert got[5][tier]["peak"] <= limit


def test_gpu_budget_holding_the_ahead_working_memory_runs_ahead(models):
    """The gpu budget fallback is about the ahead working memory only: with the block-by-block peak plus
    `_ahead_bytes`, the blocks run ahead (the parked homes are on the host)."""
    loaded = models["llama"]
    V = loaded.config.vocab_size
    blocks = [(make_prompts(6, V, seed=s), MAX_NEW) for s in (1, 2, 3)]
    ref, free = both(loaded, BASE, blocks)
    probe = Executor(loaded, Policy(**BASE, prefill_ahead=True), device=torch.device("cpu"), dtype=torch.float32)
    try:
        ahead = max(probe._ahead_bytes(probe._batches(p, m), -(-6 // (max(MAX_NEW) - 1))) for p, m in blocks[1:])
    finally:
        probe.close()
    assert ahead > 0
    limit = ref[5]["gpu"]["peak"] + ahead
    got = run_blocks(loaded, Policy(**BASE, prefill_ahead=True), blocks, gpu_memory=limit)
    assert got[1] == [0.0, 1.0, 1.0]
    assert got[0] == ref[0]
    assert got[5]["gpu"]["peak"] <= limit


# ---- 5. the schedules from step `first` ------------------------------------------------------------------
@pytest.mark.parametrize("steps,layers,batches", [(2, 4, 1), (3, 6, 1), (3, 6, 2), (4, 5, 3), (2, 8, 4)])
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("first", [1, 2])
def test_block_schedule_from_first(steps, layers, batches, paged, first):
    actions = list(block_schedule(steps, layers, batches, paged=paged, first=first))
    if first >= steps:
        assert actions == []
        return
    computes = [(a.i, a.j, a.k) for a in actions if a.verb == "compute"]
    assert computes == list(slots(steps, layers, batches, first))
    assert computes == [(i, j, k) for i in range(first, steps) for j in range(layers) for k in range(batches)]
    assert min(a.i for a in actions) == first
    pages = batches if paged else 1
    assert actions[:pages] == [("load_weight", first, 0, 0, p, pages) for p in range(pages)]
    seen = {}
    for n, a in enumerate(actions):
        key = (a.verb, a.i, a.j, a.page if a.verb == "load_weight" else a.k)
        assert key not in seen or a.verb == "sync", f"{key} issued twice"
        seen.setdefault(key, n)
    previous = None                                         # the last compute's batch
    for n, a in enumerate(actions):
        if a.verb == "compute":
            for p in range(pages):
                assert seen[("load_weight", a.i, a.j, p)] < n
            assert seen[("load_cache", a.i, a.j, a.k)] < n
            assert previous == a.k or seen[("load_hidden", a.i, a.j, a.k)] < n    # the same batch: no reload
            previous = a.k
        elif a.verb in ("store_cache", "store_hidden"):
            assert seen[("compute", a.i, a.j, a.k)] < n
    # the cache/hidden moves of the full schedule's steps [first, steps), each once
    moves = ("load_cache", "load_hidden", "store_cache", "store_hidden")
    full = block_schedule(steps, layers, batches, paged=paged)
    ours = Counter(a for a in actions if a.verb in moves)
    theirs = Counter(a for a in full if a.verb in moves and a.i >= first)
    assert not theirs - ours                  # the prologue's hidden load may be extra (its batch follows another
    assert ours - theirs <= Counter([Action("load_hidden", first, 0, 0)])    # step's last layer in the full one)


def test_block_schedule_first_at_or_past_the_end_is_empty():
    assert list(block_schedule(1, 4, 2, first=1)) == []
    assert list(block_schedule(3, 4, 2, first=3)) == []
    assert list(moe_block_schedule(1, ["embed", "attention", "mlp", "head"], 2, pages=2, pipelined=True,
                                   first=1)) == []


@pytest.mark.parametrize("batches,paged", [(1, False), (2, True), (3, True), (3, False)])
@pytest.mark.parametrize("first", [1, 2])
def test_block_schedule_from_first_never_overwrites_weights_in_use(batches, paged, first):
    kinds = ["embed", "attention", "mlp", "attention", "mlp", "head"]
    assert_weight_loads_wait_for_computes(block_schedule(first + 3, len(kinds), batches, paged=paged, first=first),
                                          kinds, batches)


def _kinds(decoder_layers: int) -> list[str]:
    return ["embed", *(["attention", "mlp"] * decoder_layers), "head"]


@pytest.mark.parametrize("steps,layers,batches,pages", [(2, 1, 1, 1), (3, 2, 1, 4), (3, 2, 2, 1), (2, 3, 3, 3),
                                                         (4, 2, 4, 2)])
@pytest.mark.parametrize("pipelined", [True, False])
def test_moe_schedule_from_step_one(steps, layers, batches, pages, pipelined):
    kinds = _kinds(layers)
    J = len(kinds)
    actions = list(moe_block_schedule(steps, kinds, batches, pages=pages, pipelined=pipelined, first=1))
    computes = [(a.i, a.j, a.k) for a in actions if a.verb == "compute"]
    assert computes == list(slots(steps, J, batches, 1))
    assert min(a.i for a in actions) == 1
    assert actions[:pages] == [("load_weight", 1, 0, 0, p, pages) for p in range(pages)]
    pos = {}
    for n, a in enumerate(actions):
        key = (a.verb, a.i, a.j, a.page if a.verb == "load_weight" else a.k)
        assert key not in pos or a.verb == "sync", f"{key} issued twice"
        pos.setdefault(key, n)
    for i, j, k in computes:
        for p in range(pages):
            assert pos[("load_weight", i, j, p)] < pos[("compute", i, j, k)]
    joins = sorted((a.i, a.j, a.k) for a in actions if a.verb == "join_attention")
    attn = [j for j, kind in enumerate(kinds) if kind == "attention"]
    expected = sorted((i, j, k) for i in range(1, steps) for j in attn for k in range(batches)) if pipelined else []
    assert joins == expected
    for i, j, k in joins:
        assert pos[("compute", i, j, k)] < pos[("join_attention", i, j, k)] < pos[("compute", i, j + 1, k)]
    base = [a for a in block_schedule(steps, J, batches, paged=False, first=1) if a.verb not in ("load_weight",
                                                                                              "compute")]
    assert [a for a in actions if a.verb not in ("load_weight", "compute", "join_attention")] == base


@pytest.mark.parametrize("batches,pages", [(1, 1), (2, 2), (3, 5)])
@pytest.mark.parametrize("pipelined", [True, False])
def test_moe_schedule_from_first_never_overwrites_weights_in_use(batches, pages, pipelined):
    kinds = _kinds(3)
    rule = WeightSlots(kinds)
    held: dict[tuple[str, int], tuple[int, int]] = {}
    reads: dict[tuple[int, int], int] = {}
    needs: dict[tuple[int, int], int] = {}
    for a in moe_block_schedule(4, kinds, batches, pages=pages, pipelined=pipelined, first=1):
        layer, buffer = (a.i, a.j), (kinds[a.j], rule.slot(a.i, a.j))
        if a.verb in ("compute", "join_attention"):
            assert held.get(buffer) == layer, f"{a} reads {held.get(buffer)}'s weights"
            reads[layer] = reads.get(layer, 0) + 1
            needs[layer] = batches * (2 if pipelined and kinds[a.j] == "attention" and a.j >= 1 else 1)
        elif a.verb == "load_weight":
            previous = held.get(buffer)
            if previous is not None and previous != layer:
                assert reads.get(previous, 0) == needs[previous], f"page {a.page} of {layer} overwrites {previous}"
            held[buffer] = layer


# ---- 6. teardown -----------------------------------------------------------------------------------------
def test_close_after_ahead_blocks_frees_every_buffer_without_the_cyclic_gc(models):
    loaded = models["opt"]
    ex = Executor(loaded, Policy(**BASE, cache_gpu=0.5, cache_cpu=0.5, prefill_ahead=True),
                  device=torch.device("cpu"), dtype=torch.float32)
    flags = []
    for _ in ex.generate_blocks([(make_prompts(6, loaded.config.vocab_size, seed=s), MAX_NEW, GreedyRecorder())
                                 for s in (1, 2, 3)]):
        flags.append(ex.stats["prefill_ahead"])
    assert flags == [0.0, 1.0, 1.0]
    keys = set(ex.arena._flat)
    assert any(k.startswith("kvpark.") for k in keys) and any(k.startswith("kvx.") for k in keys)
    refs = [weakref.ref(flat) for _, flat in ex.arena._flat.values()]
    assert all(r() is not None for r in refs)
    gc.disable()
    try:
        ex.close()
        assert [r for r in refs if r() is not None] == []
        assert all(v == 0 for v in ex.budget.used.values())
        assert ex.ahead is None
    finally:
        gc.enable()


def test_error_in_the_ahead_pass_drops_it_and_the_executor_runs_on(models):
    """A selector raising inside block 1's ahead pass: the error reaches the caller, the ahead prefill's
    reservation and homes are given back, and the same executor then runs the blocks as a fresh one does."""
    loaded = models["llama"]
    V = loaded.config.vocab_size
    policy = Policy(**BASE, cache_gpu=0.5, cache_cpu=0.5, prefill_ahead=True)
    blocks = [(make_prompts(6, V, seed=s), MAX_NEW) for s in (1, 2, 3)]
    ref = run_blocks(loaded, policy, blocks)

    class Boom(GreedyRecorder):
        def __call__(self, rows, logits):
            raise RuntimeError("boom")

    ex = Executor(loaded, policy, device=torch.device("cpu"), dtype=torch.float32)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            for _ in ex.generate_blocks([(*blocks[0], GreedyRecorder()), (*blocks[1], Boom())]):
                pass
        assert ex.ahead is None and ex._ahead_work == 0
        assert not any(k.startswith("kvpark.") for k in ex.arena._flat)
        sels, flags = [GreedyRecorder() for _ in blocks], []
        for _ in ex.generate_blocks([(p, m, s) for (p, m), s in zip(blocks, sels)]):
            flags.append(ex.stats["prefill_ahead"])
        assert flags == [0.0, 1.0, 1.0]
        assert [s.tokens for s in sels] == ref[0]
    finally:
        ex.close()


# ---- a next block longer than the running one ---------------------------------------------------------------------------------------------
def test_ahead_block_longer_than_the_running_blocks_rope_table(tmp_path):
    """Block 0 is short (its RoPE table reserved to 256 positions), block 1's prompts are 300+ tokens (within
    the model's 1024 positions): the ahead prefill must give the block-by-block tokens. A freshly loaded model,
    and the ahead run first: a run that had grown the family's table before would hide the bug."""
    import transformers

    spec = dict(TINY_CONFIGS["llama"], max_position_embeddings=1024)
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "llama1k")
    loaded = load_model(tmp_path / "llama1k", dtype=torch.float32)
    V = loaded.config.vocab_size
    blocks = [(make_prompts(6, V, seed=1, lo=3, hi=10), [4] * 6), (make_prompts(6, V, seed=2, lo=300, hi=320), [3] * 6)]
    got = run_blocks(loaded, Policy(**BASE, prefill_ahead=True), blocks)
    ref = run_blocks(loaded, Policy(**BASE), blocks)
    assert got[1] == [0.0, 1.0]
    assert got[0] == ref[0]


def test_ahead_stores_take_a_ring_of_staging_buffers(monkeypatch):
    """An ahead prefill's cache stores take `ahead_stage_slots` staging buffers in turn (one per attention layer
    up to 16), not two: with two, the compute thread waits for the store two back (Mixtral-8x7B at
    512/32/24 GiB). The tokens stay those of the block-by-block run."""
    import engine.runtime.kv_cache as kv_cache
    from engine.calibrate.trial import truncated_model
    from engine.models.hf_config import config_from_hf
    from engine.models.presets import PRESETS
    from engine.policy.buffers import ahead_stage_slots

    loaded = truncated_model(config_from_hf(PRESETS["tiny-llama"]), 20, torch.float32)
    slots, store = [], kv_cache.KVHome.store

    def recorded(self, transfers, slot, claims):
        slots.append(slot)
        return store(self, transfers, slot, claims)

    monkeypatch.setattr(kv_cache.KVHome, "store", recorded)
    blocks = [(make_prompts(2, loaded.config.vocab_size, seed=s), [3, 3]) for s in (1, 2)]
    ref, got = both(loaded, dict(gpu_batch_size=2), blocks)
    assert got[1] == [0.0, 1.0] and got[0] == ref[0]
    ahead = [s for s in slots if str(s).startswith("ahead")]
    assert ahead_stage_slots(20) == 16
    assert ahead[:17] == [f"ahead{n % 16}" for n in range(17)]
