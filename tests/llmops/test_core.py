"""map_table on the fake engine: order, nulls, dedup, cache and resume, per-row errors, dtypes, summary."""
from __future__ import annotations

import pyarrow as pa
import pytest

from helpers.fake_engine import FakeLLM
from llmops import engines
from llmops.core import MapSpec, last_summary, map_table, map_table_ordered, output_schema, output_type
from llmops.templates import TemplateError

BODIES = ["alpha one", "beta two", None, "alpha one", "gamma three", "delta four", "beta two", "eps five"]


@pytest.fixture
def table():
    return pa.table({"body": BODIES, "n": list(range(len(BODIES)))})


def test_rows_come_back_in_row_order_with_nulls_and_dedup(table):
    eng = FakeLLM(block_size=2)
    out = map_table_ordered(table, MapSpec("Say {body}"), engine=eng, cache_dir=False)
    assert out.column("row").to_pylist() == list(range(8))
    assert out.column("output").to_pylist() == [None if b is None else f"echo: Say {b}" for b in BODIES]
    assert out.column("finish_reason").to_pylist()[2] is None
    assert eng.prompts_seen == 5 and set(eng.seen.values()) == {1}
    s = last_summary()
    assert (s.rows, s.nulls, s.deduped, s.generated_rows, s.errors, s.cache_hits) == (8, 1, 2, 5, 0, 0)
    assert s.generated_tokens == sum(len(f"echo: Say {b}".split()) for b in set(BODIES) - {None})


def test_batches_stream_per_block_and_cover_every_row_once(table):
    run = map_table(table, MapSpec("Say {body}"), engine=FakeLLM(block_size=2), cache_dir=False)
    batches = list(run)
    assert len(batches) == 1 + 3          # the null row first, then 5 distinct prompts in blocks of 2
    rows = [r for b in batches for r in b.column("row").to_pylist()]
    assert sorted(rows) == list(range(8))
    assert all(b.schema == output_schema(run.spec) for b in batches)
    assert run.summary.done_rows == 8


def test_cache_hits_and_resume_after_crash(table, tmp_path):
    spec = MapSpec("Say {body}")
    crashing = FakeLLM(block_size=2, fail_at_block=2)
    with pytest.raises(RuntimeError, match="crashed at block 2"):
        list(map_table(table, spec, engine=crashing, cache_dir=tmp_path))
    assert crashing.prompts_seen == 4
    resumed = FakeLLM(block_size=2)
    run = map_table(table, spec, engine=resumed, cache_dir=tmp_path)
    out = run.ordered()
    assert resumed.prompts_seen == 1       # only the prompt of the block that never finished
    assert not set(crashing.seen) & set(resumed.seen)
    assert out.column("output").to_pylist() == [None if b is None else f"echo: Say {b}" for b in BODIES]
    assert run.summary.cache_hits == 6     # 4 distinct cached prompts cover 6 rows
    third = FakeLLM()
    assert map_table_ordered(table, spec, engine=third, cache_dir=tmp_path).equals(out)
    assert third.prompts_seen == 0


def test_cache_key_includes_fingerprint_and_params(table, tmp_path):
    map_table_ordered(table, MapSpec("Say {body}"), engine=FakeLLM(), cache_dir=tmp_path)
    other_model = FakeLLM(fingerprint="other")
    map_table_ordered(table, MapSpec("Say {body}"), engine=other_model, cache_dir=tmp_path)
    other_params = FakeLLM()
    map_table_ordered(table, MapSpec("Say {body}", max_new_tokens=2), engine=other_params, cache_dir=tmp_path)
    assert other_model.prompts_seen == 5 and other_params.prompts_seen == 5


def test_template_error_before_any_generation(table):
    eng = FakeLLM()
    with pytest.raises(TemplateError, match=r"'bdy'.*available columns: body, n"):
        map_table(table, MapSpec("Say {bdy}"), engine=eng, cache_dir=False)
    assert eng.calls == 0


def test_per_row_errors_do_not_stop_the_job():
    table = pa.table({"body": pa.array([b"ok", b"\xff\xfe", b"x" * 50, b"fine"], pa.binary())})
    out = map_table_ordered(table, MapSpec("{body}"), engine=FakeLLM(max_context=20), cache_dir=False)
    assert out.column("output").to_pylist() == ["echo: ok", None, None, "echo: fine"]
    assert out.column("finish_reason").to_pylist() == ["stop", "error", "error", "stop"]
    errors = out.column("error").to_pylist()
    assert "row 1" in errors[1] and "invalid UTF-8" in errors[1]
    assert "exceeds the context of 20" in errors[2]
    assert last_summary().errors == 2


def test_truncate_long_prompts():
    table = pa.table({"body": ["short", "y" * 100]})
    spec = MapSpec("{body}", on_long_prompt="truncate", max_new_tokens=4)
    out = map_table_ordered(table, spec, engine=FakeLLM(max_context=40), cache_dir=False)
    assert out.column("finish_reason").to_pylist() == ["stop", "stop"]
    assert out.column("output")[1].as_py() == "echo: " + "y" * (40 - 4)  # the engine's exact count


def test_schema_output_is_typed_and_cut_rows_are_null():
    table = pa.table({"body": ["Oslo", "CUT here", None]})
    spec = MapSpec("Extract: {body}", schema={"city": str, "zip": int, "score": float})
    out = map_table_ordered(table, spec, engine=FakeLLM(), cache_dir=False)
    assert out.schema.field("output").type == output_type(spec) == pa.struct(
        [("city", pa.string()), ("zip", pa.int64()), ("score", pa.float64())])
    first = out.column("output")[0].as_py()
    assert set(first) == {"city", "zip", "score"} and isinstance(first["zip"], int)
    assert out.column("output")[1].as_py() is None
    assert out.column("finish_reason").to_pylist() == ["stop", "length", None]
    assert last_summary().truncated == 1


def test_choices_and_plain_types():
    table = pa.table({"body": ["a billing question", "crash bug", "hello"]})
    spec = MapSpec("Label: {body}", choices=["bug", "billing", "other"])
    eng = FakeLLM()
    out = map_table_ordered(table, spec, engine=eng, cache_dir=False)
    assert out.column("output").to_pylist()[:2] == ["billing", "bug"]
    assert out.column("output")[2].as_py() in spec.choices
    assert out.schema.field("output").type == pa.string()
    assert eng.last_params.choices == ("bug", "billing", "other")
    assert output_type(MapSpec("{x}", regex=r"\d+")) == pa.string()


def test_few_shot_messages_reach_the_engine(table):
    eng = FakeLLM()
    spec = MapSpec("Q {body}", system="sys", examples=({"input": {"body": "e"}, "output": "E"},))
    map_table_ordered(table, spec, engine=eng, cache_dir=False)
    prompt = next(iter(eng.seen))
    assert '"role": "system"' in prompt and '"content": ["Q ", {"data": "e"}]' in prompt
    assert '"content": [{"data": "E"}]' in prompt and '"content": ["sys"]' in prompt


def test_mapspec_hash_round_trip_and_validation():
    spec = MapSpec("T {a}", examples=[{"input": {"a": "1"}, "output": {"x": 1}}], schema={"x": int},
                   stop=["\n"], engine={"dtype": "bfloat16", "policy": "auto"})
    again = MapSpec.from_dict(spec.to_dict())
    assert again == spec and hash(again) == hash(spec)
    assert spec.engine == (("dtype", "bfloat16"), ("policy", "auto")) and spec.stop == ("\n",)
    with pytest.raises(ValueError, match="unknown field"):
        MapSpec.from_dict({"template": "{a}", "tempreature": 1})
    with pytest.raises(ValueError, match="at most one"):
        MapSpec("{a}", choices=["x"], regex="y")
    with pytest.raises(ValueError, match="max_new_tokens"):
        MapSpec("{a}", max_new_tokens=0)
    with pytest.raises(TemplateError):
        MapSpec("{a}", examples=[{"input": {"b": 1}, "output": "x"}])


def test_engine_factory_override_and_reuse():
    built = []

    def factory(model, **settings):
        built.append((model, settings))
        return FakeLLM()

    previous = engines.set_factory(factory)
    try:
        table = pa.table({"body": ["a", "b"]})
        spec = MapSpec("{body}", model="m", engine={"dtype": "float32"})
        map_table_ordered(table, spec, cache_dir=False)
        map_table_ordered(table, spec, cache_dir=False)
        assert built == [("m", {"dtype": "float32"})]
    finally:
        engines.set_factory(previous)
