"""One job, one plan: workload buckets, the plan cache, and planning counted across engine calls, DuckDB
vectors, Polars groups and streaming morsels (a real `engine.LLM` on a tiny random checkpoint, on the CPU,
with the policy search and executor construction counted)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import pyarrow as pa
import pytest
import torch

import engine.calibrate.planning.choose as choose
import engine.runtime.executor as executor_mod
from engine import LLM, Policy, SamplingParams
from engine.calibrate.planning import Plan, PlanCache
from engine.calibrate.planning.workload import (EXACT_COUNT_MAX, EXACT_COUNT_MIN, bucket, bucketed,
                                                bucketed_workload, count_bucket, merged, prompts_prefix_len,
                                                workload_list)
from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy.cost_model import Workload, estimate
from engine.policy.estimate import Budgets, PolicyEstimate
from engine.policy.hardware import GIB, reference_profile
from engine.policy.search import search
from engine.runtime.layout import model_layout
from llmops import engines
from llmops.coalesce import COALESCE_BLOCKS, Coalescer, for_job


@pytest.mark.parametrize("n, expected", [(1, 1), (8, 8), (9, 10), (16, 16), (17, 20), (100, 112), (200, 224)])
def test_bucket_rounds_up_four_steps_per_octave(n, expected):
    assert bucket(n) == expected


@pytest.mark.parametrize("n, expected", [(1, 1), (5, 8), (EXACT_COUNT_MIN, EXACT_COUNT_MIN),
                                         (EXACT_COUNT_MIN + 1, EXACT_COUNT_MIN + 1), (4608, 4608),
                                         (EXACT_COUNT_MAX, EXACT_COUNT_MAX), (EXACT_COUNT_MAX + 1, 2 * EXACT_COUNT_MAX),
                                         (1_000_000, 1 << 20), (None, None)])
def test_count_bucket_is_the_count_between_its_bounds_else_a_power_of_two(n, expected):
    assert count_bucket(n) == expected


def test_a_short_jobs_own_count_plans_it_faster_than_the_next_power_of_two():
    """4,608 rows of the 70B wrangling shape: planned for 8,192 rows the job gets a 4,096-row block and a
    second block an eighth full; planned for its own count, a plan whose blocks it fills (the prediction
    for the job's own rows, both plans)."""
    config = config_from_hf(PRESETS["llama-3-70b"])
    layout = model_layout(config)
    job = Workload(200, 10, num_prompts=4608, max_prompt_len=224, shared_prefix_len=150)
    budgets, profile = Budgets(16 * GIB, 88 * GIB), reference_profile("h200")
    flags = dict(compress_weights=True, compress_cache=True, layout=layout)
    own = search(config, bucketed_workload(job), budgets, profile, **flags).policy
    power = search(config, replace(bucketed_workload(job), num_prompts=8192), budgets, profile, **flags).policy
    assert bucketed_workload(job).num_prompts == 4608 and power.block_size == 4096
    rate = {p: estimate(config, p, job, profile, layout=layout).tokens_per_s for p in (own, power)}
    assert rate[own] > 1.5 * rate[power]


def test_bucketed_workload_bounds_every_workload_inside_it():
    w = bucketed([30, 50, 70], 10)
    assert (w.num_prompts, w.gen_len, w.max_prompt_len) == (4, 10, 80)
    assert w.prompt_len == bucket(50)
    inside = bucketed([70, 75], 9)
    assert Plan(Policy(), w, "search").covers(inside)
    assert not Plan(Policy(), w, "search").covers(bucketed([90], 9))
    assert not Plan(Policy(), w, "search").covers(bucketed([10], 11))
    assert Plan(Policy()).covers(bucketed([10_000], 500))          # a fixed policy covers everything


def test_buckets_keep_the_shared_prefix_and_round_the_rows_own_tokens():
    """Rows of 150 shared + 50 own tokens (the wrangle shape): planned as 144 + 56, not as 224 tokens; a plan covers
    prompts sharing at least its prefix; a merged bucket has the smaller prefix."""
    w = bucketed([200] * 1536, 10, 150)
    assert (w.prompt_len, w.shared_prefix_len, w.max_prompt_len, w.num_prompts) == (200, 144, 224, 1536)
    assert bucketed([200] * 8, 10, 15).shared_prefix_len == 0 and bucketed([200] * 8, 10).prompt_len == 224
    plan = Plan(Policy(), w, "search")
    assert plan.covers(bucketed([200] * 8, 10, 150)) and plan.covers(bucketed([200] * 8, 10, 199))
    assert not plan.covers(bucketed([200] * 8, 10, 100))       # shares less: more to compute and to hold
    assert merged(w, bucketed([180], 10, 100)).shared_prefix_len == 96


def test_plans_know_the_prefix_the_prompts_share(tiny_llama, counted, monkeypatch):
    """The planner's workload carries the token prompts' common prefix (rounded down to 16); a plan made from
    a sample carries the sample's, and a call whose prompts share less is not covered by it: the job's plan
    grows to the bucket holding both (the smaller prefix) once its policy is checked to fit that."""
    planned = []
    search = choose.cost_model_choice

    def recording(config, workload, *args, **kwargs):
        planned.append(workload)
        return search(config, workload, *args, **kwargs)

    monkeypatch.setattr(choose, "cost_model_choice", recording)
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    params = SamplingParams(max_new_tokens=2)
    prompts = [ids(1, 20, offset=7)[0] + own for own in ids(6, 5)]          # 20 shared tokens, 5 own
    llm.generate(prompts, params)
    assert llm.last_plan.workload.shared_prefix_len == 16 and planned[-1].shared_prefix_len == 16
    sample = llm.plan(prompts[:3], params, rows=1000)
    assert sample.workload.shared_prefix_len == 16 and sample.workload.num_prompts == 1024
    assert not sample.covers(bucketed([25] * 6, 2))
    searches = len(planned)
    llm.generate(ids(6, 25), params, plan=sample)           # the policy fits the merged bucket: kept, not re-planned
    assert llm.last_plan.workload.shared_prefix_len == 0 and len(planned) == searches
    assert llm.last_plan.policy == sample.policy


def test_prompts_prefix_len_is_the_executors_rule():
    assert prompts_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4, 6]]) == 3
    assert prompts_prefix_len([[1, 2, 3], [1, 2, 3, 4]]) == 2          # every prompt keeps a token
    assert prompts_prefix_len([[1, 2, 3]]) == 0 and prompts_prefix_len([]) == 0
    est = choose.choose_policy_estimate(preset_config("tiny-llama"), prompts=[[5] * 9 + [6], [5] * 9 + [7]],
                                        max_new_tokens=4, device="cpu", dtype=torch.float32, gpu_memory=1 << 30,
                                        cpu_memory=None)
    assert est.context["workload"]["shared_prefix_len"] == 9 and est.context["workload"]["prompt_len"] == 10


def test_plan_cache_round_trip_and_rejects_other_keys_and_corrupt_files(tmp_path):
    cache = PlanCache(tmp_path)
    key = {"config": {"hidden_size": 64}, "workload": [8, 4, 2, 8, 4]}
    policy = Policy(gpu_batch_size=6, num_gpu_batches=2)
    est = PolicyEstimate(policy, 12.5, 1.0, 2.0, {"gpu": 1 << 20, "cpu": 0, "disk": 0}, {"prefill": "compute"},
                         {"model": "tiny", "trials": [{"policy": policy.to_dict(), "predicted_tokens_per_s": 13.0,
                                                       "trial_tokens_per_s": 12.5}]})
    plan = Plan(policy, Workload(8, 4, 2, 8, shared_prefix_len=4), "trials", "trials", est, 3.0)
    stored = cache.put(key, plan)
    assert stored.cache_file == str(cache.path(key))
    got = cache.get(key)
    assert got is not None and (got.source, got.chosen_by) == ("disk", "trials")
    assert (got.policy, got.workload, got.predicted_tokens_per_s) == (plan.policy, plan.workload, 12.5)
    assert got.estimate.context["trials"] == est.context["trials"] and got.to_dict()["predicted_decode_s"] == 2.0
    assert "plan cache" in got.explain() and "trials" in got.explain()
    assert cache.get({**key, "workload": [8, 4, 4, 8, 4]}) is None
    assert cache.get({**key, "workload": [8, 4, 2, 8, 0]}) is None
    cache.path(key).write_text(cache.path(key).read_text().replace('"gpu_batch_size": 6', '"gpu_batch_size": 7'))
    assert cache.get(key) is None                                  # an altered file fails its digest
    cache.path(key).write_text("{not json")
    assert cache.get(key) is None


@pytest.fixture
def counted(monkeypatch):
    """Counts of policy searches and executor builds while the test runs."""
    counts = {"plans": 0, "executors": 0}
    search = choose.cost_model_choice

    def counting_search(*args, **kwargs):
        counts["plans"] += 1
        return search(*args, **kwargs)

    class CountingExecutor(executor_mod.Executor):
        def __init__(self, *args, **kwargs):
            counts["executors"] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(choose, "cost_model_choice", counting_search)
    monkeypatch.setattr(executor_mod, "Executor", CountingExecutor)
    return counts


def preset_config(name: str):
    return config_from_hf(PRESETS[name])


def ids(n: int, length: int, offset: int = 0) -> list[list[int]]:
    return [[3 + (offset + i + t) % 300 for t in range(length)] for i in range(n)]


def test_calls_in_one_bucket_plan_once_and_keep_the_executor(tiny_llama, counted):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    params = SamplingParams(max_new_tokens=3)
    llm.generate(ids(5, 12), params)
    first = llm.last_plan
    llm.generate(ids(7, 11, offset=50), params)
    assert counted == {"plans": 1, "executors": 1}
    assert first.source == "search" and llm.last_plan.source == "memory"
    assert llm.last_plan.policy == first.policy


def test_a_given_plan_is_kept_for_every_call_it_covers(tiny_llama, counted):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    params = SamplingParams(max_new_tokens=2)
    plan = llm.plan(ids(64, 20), params)
    assert counted["plans"] == 1
    for n, length in ((3, 5), (40, 17), (1, 20)):
        llm.generate(ids(n, length), params, plan=plan)
        assert llm.last_plan is plan
    assert counted == {"plans": 1, "executors": 1}
    longer = llm.plan(ids(2, 60), params, covering=plan)        # longer prompts: the policy still fits them
    assert counted["plans"] == 1 and longer.policy == plan.policy and longer.covers(bucketed([20, 60], 2))


@pytest.fixture
def tiny_engine(tiny_llama):
    """The process-wide engine factory pointed at the tiny checkpoint (operator adapters build it)."""
    engines.set_factory(lambda model, **settings: LLM(tiny_llama, dtype="float32", device="cpu"))
    yield
    engines.set_factory(None)


def test_duckdb_query_over_three_vectors_is_one_job(tiny_engine, counted):
    duckdb = pytest.importorskip("duckdb")
    import llmops
    import llmops.duckdb

    con = duckdb.connect()
    con.execute("SET threads=1")
    llmops.duckdb.register(con, name="f", template="item {x}", max_new_tokens=1, cache_dir=False, chat=False)
    rows = con.sql("SELECT f(CAST(i AS VARCHAR)) AS o FROM range(4500) t(i)").fetchall()
    assert len(rows) == 4500 and all(r[0] is not None for r in rows)
    summary = llmops.last_summary()
    assert (summary.calls, summary.rows, summary.generated_rows) == (3, 4500, 4500)
    assert counted == {"plans": 1, "executors": 1}


def test_polars_groups_and_streaming_morsels_are_one_job(tiny_engine, counted, tmp_path):
    pl = pytest.importorskip("polars")
    import llmops

    df = pl.DataFrame({"x": [f"v{i}" for i in range(600)], "g": [i % 7 for i in range(600)]})
    expr = llmops.llm_map("item {x}", max_new_tokens=1, cache_dir=False, chat=False)
    grouped = df.group_by("g").agg(expr.alias("o"))
    assert grouped["o"].list.len().sum() == 600
    assert counted["plans"] == 1
    df.write_parquet(tmp_path / "in.parquet", row_group_size=100)
    streamed = llmops.llm_map("row {x}", max_new_tokens=1, cache_dir=False, chat=False)
    batches = list(pl.scan_parquet(tmp_path / "in.parquet").with_columns(streamed.alias("o")).collect_batches())
    assert len(batches) > 1
    assert sum(b.height for b in batches) == 600 and all(b["o"].null_count() == 0 for b in batches)
    summary = llmops.last_summary()
    assert summary.calls > 1 and summary.rows == 600
    # the streaming job plans for its first morsel, and at most once more when merged morsels outgrow it
    assert counted["plans"] <= 3 and counted["executors"] == 1


def _first_run_held(fn: Callable[[pa.Table], pa.Table]) -> tuple[Callable[[pa.Table], pa.Table], list[int],
                                                                   threading.Event, threading.Event]:
    """`fn` wrapped so its first run waits for `release` (set `started` when it begins); `seen` gets the rows
    of every run."""
    release, started = threading.Event(), threading.Event()
    seen: list[int] = []

    def held(table: pa.Table) -> pa.Table:
        seen.append(table.num_rows)
        if len(seen) == 1:
            started.set()
            release.wait(timeout=60)
        return fn(table)

    return held, seen, release, started


def _call_while_first_runs(co: Coalescer, release: threading.Event, started: threading.Event,
                           first: Callable[[], None], others: list[Callable[[], None]]) -> None:
    """Start `first`, queue `others` behind its run, then let the run finish and wait for every caller."""
    threads = [threading.Thread(target=first)]
    threads[0].start()
    started.wait(timeout=60)
    threads += [threading.Thread(target=call) for call in others]
    for t in threads[1:]:
        t.start()
    while len(co._pending) < len(others):          # the callers are queued behind the running call
        threading.Event().wait(0.001)
    release.set()
    for t in threads:
        t.join()


def test_coalescer_merges_concurrent_calls_and_slices_results_back():
    fn, seen, release, started = _first_run_held(
        lambda table: pa.table({"y": [v * 10 for v in table.column("x").to_pylist()]}))
    co = Coalescer(fn)
    results: dict[int, list[int]] = {}

    def call(i: int) -> Callable[[], None]:
        def run() -> None:
            results[i] = co(pa.table({"x": [i * 100 + k for k in range(i + 1)]})).column("y").to_pylist()
        return run

    _call_while_first_runs(co, release, started, call(0), [call(i) for i in (1, 2, 3)])
    assert seen == [1, 2 + 3 + 4]                        # the three waiting calls ran as one
    for i in range(4):
        assert results[i] == [(i * 100 + k) * 10 for k in range(i + 1)]


def test_coalescer_raises_a_runs_error_in_its_callers():
    co = Coalescer(lambda table: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        co(pa.table({"x": [1]}))


def test_a_job_whose_calls_outgrow_its_first_plan_replans_once(tiny_llama, counted):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    params = SamplingParams(max_new_tokens=1)
    small = llm.plan(ids(4, 10), params)                  # the block is bounded by the 4 prompts
    assert small.policy.block_size <= 4
    grown = llm.plan(ids(64, 10), params, covering=small)
    again = llm.plan(ids(60, 9), params, covering=grown)
    assert counted["plans"] == 2 and grown.policy.block_size > small.policy.block_size and again is grown


def test_a_plan_for_more_prompts_whose_block_fits_serves_a_smaller_bucket(tiny_llama, counted):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    params = SamplingParams(max_new_tokens=2)
    big = bucketed([10] * 8192, 2)                       # planned earlier with blocks of 16
    llm._planner._plans[tuple(workload_list(big))] = Plan(Policy(gpu_batch_size=16), big, "trials")
    plan = llm.plan(ids(100, 10), params)                # 128 prompts: the 8192-prompt plan's block fits
    assert counted["plans"] == 0 and plan.policy == Policy(gpu_batch_size=16) and plan.source == "memory"
    assert plan.workload == bucketed([10] * 100, 2)
    tiny = llm.plan(ids(8, 10), params)                  # its block of 16 does not fit 8 prompts: planned
    assert counted["plans"] == 1 and tiny.policy.block_size <= 8
    job = llm.plan(ids(4608, 10), params)                # a count planned as it is: a plan of its own
    assert counted["plans"] == 2 and job.workload.num_prompts == 4608 and job.source == "search"


def test_coalescer_prepare_failure_raises_in_its_caller_and_leaves_nothing_queued():
    def prepare(table: pa.Table) -> None:
        raise ValueError("cannot plan")

    co = Coalescer(lambda table: table, prepare=prepare, gather_s=0)
    with pytest.raises(ValueError, match="cannot plan"):
        co(pa.table({"x": [1, 2]}))
    assert co._pending == [] and co.runs == 0


def test_a_jobs_coalescer_cuts_merged_runs_to_a_few_of_its_plans_blocks():
    class FakeJob:
        plan = Plan(Policy(gpu_batch_size=4), bucketed([10] * 64, 2), "memory")
        prepared: list[int] = []

        def prepare(self, table: pa.Table) -> None:
            self.prepared.append(table.num_rows)

    fn, seen, release, started = _first_run_held(lambda table: table)
    co = for_job(FakeJob(), fn)
    tables = [pa.table({"x": [i] * 3}) for i in range(6)]
    _call_while_first_runs(co, release, started, lambda: co(tables[0]), [lambda t=t: co(t) for t in tables[1:]])
    assert COALESCE_BLOCKS * 4 == 8                      # two blocks of 4 rows: two 3-row tables per run
    assert FakeJob.prepared == [3] and seen == [3, 6, 6, 3]


def test_a_workload_plans_as_the_prompts_it_describes(tiny_llama, counted):
    """`LLM.plan(Workload)` (prompt-length statistics, what `llmops policy` gives) lands in the bucket of the prompts
    it describes and gets their plan, without planning again."""
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    from_prompts = llm.plan(ids(50, 20), SamplingParams(max_new_tokens=3))
    from_stats = llm.plan(Workload(prompt_len=20, gen_len=3, num_prompts=50))
    assert from_stats.workload == from_prompts.workload == bucketed([20] * 50, 3)
    assert from_stats.policy == from_prompts.policy and counted["plans"] == 1 and from_stats.source == "memory"
