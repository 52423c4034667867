"""The Ray runner against the local one: the same pipeline over the same rows gives the same sink, and
`llmops.ray.map_dataset` the same outputs as `map_table_ordered` (greedy decoding on a tiny random Llama
built offline, one local Ray instance with 2 CPUs)."""
from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from llmops.cli import main as cli_main
from llmops.core import MapSpec, map_table_ordered

ray = pytest.importorskip("ray")
from llmops.ray import map_dataset  # noqa: E402

ENGINE = (("device", "cpu"), ("dtype", "float32"), ("policy", "auto"))


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    yield
    ray.shutdown()


def _rows(n: int) -> pa.Table:
    return pa.table({"id": list(range(n)), "city": [f"town {i % 7} street {i}" for i in range(n)]})


def test_map_dataset_equals_the_local_map(tiny_llama, local_ray):
    spec = MapSpec(template="Where is {city}?", model=str(tiny_llama), max_new_tokens=4, engine=ENGINE)
    table = _rows(23)
    local = map_table_ordered(table, spec, cache_dir=False)
    out = map_dataset(ray.data.from_arrow(table), spec, output="where", num_engines=1, batch_rows=8,
                      cache_dir=False).to_arrow_refs()
    got = pa.concat_tables([ray.get(r) for r in out])
    assert got.column("id").to_pylist() == list(range(23))
    assert got.column("where").to_pylist() == local.column("output").to_pylist()
    assert all(v is not None for v in got.column("where").to_pylist())


def _pipeline(tmp_path, model, source: dict, sink: str) -> str:
    doc = {"name": "ray_vs_local", "model": str(model), "engine": dict(ENGINE), "cache_dir": str(tmp_path / "cache"),
           "source": source,
           "steps": [{"filter": "id % 5 <> 3"},
                     {"llm_map": {"output": "answer", "template": "Name the town of {city}.", "max_new_tokens": 5,
                                  "error_column": "why"}},
                     {"select": ["id", "answer", "why"]}],
           "sink": {"parquet": sink}}
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_a_pipeline_on_ray_writes_the_local_runners_rows(tiny_llama, local_ray, tmp_path, kind):
    table = _rows(40)
    src = tmp_path / f"in.{kind}"
    pq.write_table(table, src, row_group_size=16) if kind == "parquet" else pacsv.write_csv(table, src)
    sinks = {runner: tmp_path / f"{runner}.parquet" for runner in ("local", "ray")}
    for runner, sink in sinks.items():
        (tmp_path / runner).mkdir()
        path = _pipeline(tmp_path / runner, tiny_llama, {kind: str(src)}, str(sink))
        res = CliRunner().invoke(cli_main, ["run", path, "--runner", runner, "--json",
                                            "--no-cache"])
        assert res.exit_code == 0, res.output
        summary = json.loads(res.output[res.output.index("{"):])
        assert summary["rows_written"] == 32 and summary["source_rows"] == 40
    local, remote = pq.read_table(sinks["local"]), pq.read_table(sinks["ray"])
    assert remote.column_names == local.column_names == ["id", "answer", "why"]
    assert remote.to_pylist() == local.to_pylist()


def test_a_rerun_on_ray_is_served_from_the_result_cache(tiny_llama, local_ray, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(_rows(12), src)
    path = _pipeline(tmp_path, tiny_llama, {"parquet": str(src)}, str(tmp_path / "out.parquet"))
    runs = [CliRunner().invoke(cli_main, ["run", path, "--runner", "ray", "--json"]) for _ in range(2)]
    first, second = (json.loads(r.output[r.output.index("{"):]) for r in runs)
    assert first["generated_tokens"] > 0 and first["cache_hits"] == 0
    report = json.loads(open(first["report"]).read())
    assert report["run"]["rows_written"] == first["rows_written"] and "ray_dataset_and_sink" in report["time"]
    assert second["cache_hits"] == first["rows_written"] and second["generated_tokens"] == 0


def test_more_engines_than_the_cluster_holds_is_a_clear_error(tiny_llama, local_ray, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(_rows(4), src)
    path = _pipeline(tmp_path, tiny_llama, {"parquet": str(src)}, str(tmp_path / "out.parquet"))
    res = CliRunner().invoke(cli_main, ["run", path, "--runner", "ray", "--num-engines", "2"])
    assert res.exit_code == 2 and "the Ray cluster has 2" in res.output
    assert not (tmp_path / "out.parquet").exists()


class DiesOnce:
    """An engine whose process exits during its second `stream` call, once (a marker file remembers it):
    a worker lost mid-run."""

    def __init__(self, inner: Any, marker: str) -> None:
        self._inner, self._marker, self._calls = inner, marker, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        if self._calls == 2 and not os.path.exists(self._marker):
            open(self._marker, "w").close()
            os._exit(1)
        yield from self._inner.stream(*args, **kwargs)


def test_a_killed_engine_actor_is_restarted_and_every_row_comes_out_once(tiny_llama, local_ray, tmp_path):
    from engine import LLM  # tests may build engines directly

    marker = str(tmp_path / "died")
    spec = MapSpec(template="Where is {city}?", model=str(tiny_llama), max_new_tokens=3, engine=ENGINE)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    factory = functools.partial(_dies_once_engine, LLM, marker)
    out = map_dataset(ray.data.from_arrow(_rows(30)), spec, output="where", batch_rows=8, cache_dir=False,
                      engine_factory=factory)
    got = pa.concat_tables([ray.get(r) for r in out.to_arrow_refs()])
    assert os.path.exists(marker)                                   # the actor did die once
    assert sorted(got.column("id").to_pylist()) == list(range(30))  # every row exactly once
    assert got.column("where").null_count == 0


def _dies_once_engine(llm_class: Any, marker: str, spec: MapSpec) -> DiesOnce:
    return DiesOnce(llm_class(spec.model, **dict(spec.engine)), marker)


def test_a_semantic_step_on_ray_runs_on_the_driver_and_matches_the_local_runner(tiny_llama, local_ray, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(_rows(10), src)
    sinks = {}
    for runner in ("local", "ray"):
        folder = tmp_path / runner
        folder.mkdir()
        doc = {"name": "semantic_on_ray", "model": str(tiny_llama), "engine": dict(ENGINE), "cache_dir": False,
               "source": {"parquet": str(src)},
               "steps": [{"llm_filter": {"template": "Is {city} a big town?", "max_new_tokens": 3}},
                         {"llm_map": {"output": "answer", "template": "Name {city}.", "max_new_tokens": 3}}],
               "sink": {"parquet": str(folder / "out.parquet")}}
        (folder / "p.yaml").write_text(json.dumps(doc))
        res = CliRunner().invoke(cli_main, ["run", str(folder / "p.yaml"), "--runner", runner, "--json"])
        assert res.exit_code == 0, res.output
        sinks[runner] = pq.read_table(folder / "out.parquet")
    assert sinks["ray"].to_pylist() == sinks["local"].to_pylist()
    assert sinks["ray"].column_names[-1] == "answer" and sinks["ray"].num_rows <= 10


def test_engine_devices_must_fit_an_actor():
    """An actor sees only its own GPUs: a devices list naming more is refused before Ray runs anything."""
    from llmops.ray import check_devices

    two = MapSpec("Say {x}", engine={"devices": [0, 1]})
    with pytest.raises(ValueError, match=r"name 2 GPU\(s\) but each Ray engine actor gets 1"):
        check_devices(two, 1)
    check_devices(two, 2)
    check_devices(MapSpec("Say {x}", engine={"devices": "auto"}), 1)
    check_devices(MapSpec("Say {x}", engine={"devices": ["cpu", "cpu"]}), 0)


def _fake_engine(llm_class: Any, spec: MapSpec) -> Any:
    return llm_class()


def test_a_failed_ray_run_keeps_the_sink_and_publishes_beside_it(local_ray, tmp_path):
    from helpers import fake_engine
    from llmops.pipeline import load_pipeline
    from llmops.pipeline.ray_runner import run_pipeline_ray

    data, out = tmp_path / "in.csv", tmp_path / "out.parquet"
    data.write_text("id,body\n0,fine\n1,CUT here\n2,good\n")            # the fake cuts a "CUT" row's JSON
    pipe = tmp_path / "p.yaml"
    pipe.write_text(f"cache_dir: false\nsource: {{csv: {data}}}\nsteps:\n  - llm_map: {{output: o, template: "
                    f"'{{body}}', schema: {{n: integer}}}}\nsink: {{parquet: {out}}}\n")
    out.write_bytes(b"the previous run's rows")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(fake_engine)
    factory = functools.partial(_fake_engine, fake_engine.FakeLLM)
    held = run_pipeline_ray(load_pipeline(pipe), engine_factory=factory, allow_errors=False)
    assert held.failed_rows == 1 and out.read_bytes() == b"the previous run's rows"
    assert held.held == str(tmp_path / "out.llmops-staged.parquet") and pq.read_table(held.held).num_rows == 3
    published = run_pipeline_ray(load_pipeline(pipe), engine_factory=factory)
    assert published.held is None and pq.read_table(out).num_rows == 3
