"""Hostile OpenAI batch files (`llmops batch`): every bad line becomes an error line naming its line number and
field while every other line runs; the fields vLLM and OpenAI define are honoured or refused by name; the output
is staged beside the target and an unwritable target fails before any work."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from engine.decoding.params import Completion, SamplingParams
from helpers.fake_engine import FakeLLM
from llmops.batch_output import OutputError, StagedOutput
from llmops.cli import main
from llmops.openai_batch import run_batch

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
RECURSIVE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
    "$ref": "#/$defs/node"}


def line(custom_id: str, body: dict[str, Any], url: str = CHAT, **top: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **top})


def chat(text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


class LogprobFake(FakeLLM):
    """The fake engine, which also reports one logprob per generated token when asked (as `engine.LLM` does)
    and answers a recursive schema with a fixed two-node object."""

    def complete(self, prompt: Any, params: SamplingParams) -> Completion:
        if params.json_schema is not None and "$defs" in params.json_schema:
            return Completion('{"v": 1, "next": {"v": 2, "next": null}}', [1, 2, 3], "stop", 5)
        c = super().complete(prompt, params)
        if params.logprobs and c.finish_reason != "error":
            c.token_ids = [ord(ch) for ch in c.text]
            c.logprobs = [-0.5] * len(c.token_ids)
        return c


# ---- one bad line among good ones: (case, the raw line, what its error says after "line 2: ")

BAD_LINES = [
    ("misspelled schema type", line("b", chat(guided_json={"type": "strnig"})),
     "body.guided_json: invalid JSON schema"),
    ("unclosed regex", line("b", chat(guided_regex="(a")), "body.guided_regex: invalid regex '(a'"),
    ("repeated and empty choices", line("b", chat(guided_choice=["a", "a", ""])),
     "body.guided_choice: choices[1] 'a' is given twice"),
    ("choices as one string", line("b", chat(guided_choice="yes")), "body.guided_choice: choices must be a list"),
    ("a null choice", line("b", chat(guided_choice=["1", None])), "body.guided_choice: choices[1] must be a string"),
    ("NaN temperature", line("b", chat()).replace('"model": "m"', '"temperature": NaN'),
     "body.temperature: expected a finite number, got nan"),
    ("infinite temperature", line("b", chat()).replace('"model": "m"', '"temperature": Infinity'),
     "body.temperature: expected a finite number, got inf"),
    ("negative temperature", line("b", chat(temperature=-0.5)), "body.temperature: Input should be greater than"),
    ("top_p of zero", line("b", chat(top_p=0)), "body.top_p: Input should be greater than 0"),
    ("boolean seed", line("b", chat(seed=True)), "body.seed: expected a number, got true"),
    ("fractional max_tokens", line("b", chat(max_tokens=2.5)), "body.max_tokens: expected an integer"),
    ("zero max_tokens", line("b", chat(max_tokens=0)), "body.max_tokens: Input should be greater than or equal to 1"),
    ("empty stop string", line("b", chat(stop=[""])), "body.stop: expected a non-empty string"),
    ("dangling $ref", line("b", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}})),
     "body.response_format.json_schema.schema: invalid JSON schema: schema $ref '#/definitions/missing' points at "
     "nothing"),
    ("json_schema without its schema", line("b", chat(response_format={"type": "json_schema"})),
     "body.response_format.json_schema: required when type is json_schema"),
    ("unknown vLLM field", line("b", chat(guided_grammar="root ::= 'a'")),
     "body.guided_grammar: unknown or unsupported field"),
    ("tool calls", line("b", chat(tools=[{"type": "function"}])), "body.tools: unknown or unsupported field"),
    ("unknown top-level field", line("b", chat(), priority=3), "priority: unknown or unsupported field"),
    ("top_logprobs beyond the chosen token", line("b", chat(logprobs=True, top_logprobs=5)), "body.top_logprobs"),
    ("several completions", line("b", chat(n=2)), "body.n: only n=1"),
    ("a boolean n", line("b", chat(n=True)), "body.n: expected a number, got true"),
    ("logprobs as a string", line("b", chat(logprobs="true")), "body.logprobs: Input should be a valid boolean"),
    ("streaming", line("b", chat(stream=True)), "body.stream: Input should be False"),
    ("a penalty", line("b", chat(presence_penalty=0.5)), "body.presence_penalty: only 0 is supported"),
    ("structured_outputs grammar", line("b", chat(structured_outputs={"grammar": "root ::= 'a'"})),
     "body.structured_outputs.grammar: unknown or unsupported field"),
    ("structured_outputs with two keys", line("b", chat(structured_outputs={"choice": ["a"], "regex": "a"})),
     "body.structured_outputs: give exactly one of json, regex, choice, json_object; got regex, choice"),
    ("two constraints", line("b", chat(guided_regex="a+", structured_outputs={"choice": ["a"]})),
     "body: at most one of response_format"),
    ("no messages", line("b", {"messages": []}), "body.messages: List should have at least 1 item"),
    ("image content", line("b", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
     "body.messages[0].content[0].type"),
    ("a list of prompts", line("b", {"prompt": ["a", "b"]}, url=COMPLETIONS), "body.prompt: Input should be a valid"),
    ("empty custom_id", line("", chat()), "custom_id: String should have at least 1 character"),
    ("unknown url", line("b", chat(), url="/v1/embeddings"), "url: Input should be"),
    ("a duplicate custom_id", line("a", chat()), "custom_id 'a' is already used by line 1"),
    ("nested too deeply", "[" * 100_000, "line 2: not"),
    ("not an object", "[1, 2]", "expected a JSON object, got list"),
]


@pytest.mark.parametrize("case, text, message", BAD_LINES, ids=[c[0] for c in BAD_LINES])
def test_a_bad_line_is_an_error_line_and_the_others_run(case, text, message):
    eng = FakeLLM()
    result = run_batch([line("a", chat("first")), text, line("c", chat("third"))], model="fake", cache_dir=False,
                       engine=eng)
    first, bad, third = result.lines
    assert first["error"] is None and third["error"] is None
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "echo: first"
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"] is None
    assert bad["error"]["message"].startswith("line 2: ") and message in bad["error"]["message"], bad["error"]
    assert eng.prompts_seen == 2


GOOD_LINES = [  # (case, body, url, what the engine got: a SamplingParams check)
    ("structured_outputs choice", chat(structured_outputs={"choice": ["yes", "no"]}), CHAT,
     lambda p: p.choices == ("yes", "no")),
    ("structured_outputs regex", chat(structured_outputs={"regex": "[a-z ]+"}), CHAT, lambda p: p.regex == "[a-z ]+"),
    ("structured_outputs json", chat(structured_outputs={"json": {"type": "object", "properties": {
        "a": {"type": "integer"}}}}), CHAT, lambda p: p.json_schema["properties"]["a"]["type"] == "integer"),
    ("structured_outputs json_object", chat(structured_outputs={"json_object": True}), CHAT,
     lambda p: p.json_schema == {"type": "object"}),
    ("guided_json as JSON text", chat(guided_json='{"type": "object", "properties": {"b": {"type": "boolean"}}}'),
     CHAT, lambda p: p.json_schema["properties"] == {"b": {"type": "boolean"}}),
    ("a recursive schema", chat(response_format={"type": "json_schema", "json_schema": {"schema": RECURSIVE}}), CHAT,
     lambda p: "$defs" in p.json_schema),
    ("vLLM top_k off", chat(top_k=-1, temperature=0.3, seed=5), CHAT,
     lambda p: (p.top_k, p.temperature, p.seed) == (0, 0.3, 5)),
    ("ignored informational fields", chat(user="u1", metadata={"k": "v"}, frequency_penalty=0), CHAT,
     lambda p: p.temperature == 1.0),
]


@pytest.mark.parametrize("case, body, url, check", GOOD_LINES, ids=[c[0] for c in GOOD_LINES])
def test_supported_fields_reach_the_engine(case, body, url, check):
    eng = LogprobFake()
    (out,) = run_batch([line("x", body, url=url)], model="fake", cache_dir=False, engine=eng).lines
    assert out["error"] is None, out["error"]
    assert check(eng.last_params)
    content = out["response"]["body"]["choices"][0]["message"]["content"]
    if eng.last_params.choices is not None:
        assert content in eng.last_params.choices
    if case == "a recursive schema":
        assert json.loads(content) == {"v": 1, "next": {"v": 2, "next": None}}


def test_logprobs_come_back_in_openai_shape(tmp_path):
    eng = LogprobFake()
    lines = [line("c", chat("hi", logprobs=True, top_logprobs=0)), line("p", {"prompt": "ab", "logprobs": 0},
                                                                        url=COMPLETIONS),
             line("n", chat("hi"))]
    for cache in (tmp_path, tmp_path):            # the second run is served from the cache, logprobs included
        c, p, n = run_batch(lines, model="fake", cache_dir=cache, engine=eng).lines
        choice = c["response"]["body"]["choices"][0]
        text = choice["message"]["content"]
        assert [t["token"] for t in choice["logprobs"]["content"]] == list(text)
        assert all(t["logprob"] == -0.5 and t["top_logprobs"] == [] and t["bytes"] == list(t["token"].encode())
                   for t in choice["logprobs"]["content"])
        legacy = p["response"]["body"]["choices"][0]["logprobs"]
        assert "".join(legacy["tokens"]) == p["response"]["body"]["choices"][0]["text"]
        assert legacy["token_logprobs"] == [-0.5] * len(legacy["tokens"]) and legacy["text_offset"][:2] == [0, 1]
        assert n["response"]["body"]["choices"][0]["logprobs"] is None
    assert eng.prompts_seen == 3


class FailingChoices(FakeLLM):
    """Raises for every request constrained to choices (a job-level failure of that group only)."""

    def stream(self, prompts, params=None):
        if params is not None and params.choices is not None:
            raise RuntimeError("grammar compiler crashed")
        yield from super().stream(prompts, params)


def test_a_failed_job_fails_only_its_own_lines():
    lines = [line("a", chat("one")), line("b", chat("two", guided_choice=["x", "y"])), line("c", chat("three"))]
    a, b, c = run_batch(lines, model="fake", cache_dir=False, engine=FailingChoices()).lines
    assert a["error"] is None and c["error"] is None
    assert b["response"]["status_code"] == 500 and b["error"]["code"] == "generation_failed"
    assert b["error"]["message"] == "line 2: the job of this line failed: RuntimeError: grammar compiler crashed"


def _malformed(i: int) -> str:
    kinds = ['{"custom_id": "m%d", "body": ' % i, line(f"m{i}", chat(temperature=float("nan"))),
             line(f"m{i}", chat(guided_choice=["a", "a"])), line(f"m{i}", chat(guided_regex="(x")),
             line(f"m{i}", chat(guided_json={"type": "strnig"}))]
    return kinds[i % len(kinds)]


def test_twenty_malformed_lines_in_five_thousand(tmp_path):
    bad = set(range(7, 5000, 250))                                   # 20 line indexes, spread over the file
    lines = [_malformed(i) if i in bad else line(f"r{i}", chat(f"row {i}")) for i in range(5000)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    eng = FakeLLM(block_size=512)
    out = tmp_path / "out.jsonl"
    from llmops import engines
    previous = engines.set_factory(lambda model, **s: eng)
    try:
        result = CliRunner().invoke(main, ["batch", str(tmp_path / "in.jsonl"), "-o", str(out), "--no-cache"])
    finally:
        engines.set_factory(previous)
    assert result.exit_code == 1 and "20 line(s) failed" in result.stderr and "Traceback" not in result.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 5000 and eng.prompts_seen == 4980
    errors = [i for i, r in enumerate(rows) if r["error"] is not None]
    assert errors == sorted(bad)
    assert all(rows[i]["error"]["message"].startswith(f"line {i + 1}: ") for i in errors)
    assert all(rows[i]["response"]["body"]["choices"][0]["message"]["content"] == f"echo: row {i}"
               for i in range(5000) if i not in bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]      # no staging left


@pytest.mark.parametrize("target", ["under_a_file/out.jsonl", "/sys/llmops-out/out.jsonl", "a_folder"])
def test_an_unwritable_output_fails_before_any_work(target, tmp_path, fake):
    (tmp_path / "under_a_file").write_text("a file, not a folder\n")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "in.jsonl").write_text(line("a", chat()) + "\n")
    path = target if target.startswith("/") else str(tmp_path / target)
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "in.jsonl"), "-o", path, "--no-cache"])
    assert result.exit_code == 2 and "--output" in result.stderr and path in result.stderr
    assert "Traceback" not in result.output
    assert fake.calls == 0


class StagingWatcher(FakeLLM):
    """Counts the lines already in the staging file each time it is about to yield a block."""

    def __init__(self, folder: Path, **kw: Any) -> None:
        super().__init__(**kw)
        self.folder, self.staged = folder, []

    def stream(self, prompts, params=None):
        for group in super().stream(prompts, params):
            (staging,) = self.folder.glob("*.llmops-partial-*")
            self.staged.append(len(staging.read_text().splitlines()))
            yield group


def test_answers_are_staged_as_they_finish_and_published_in_order(tmp_path):
    eng = StagingWatcher(tmp_path, block_size=2)
    lines = ["{bad"] + [line(f"r{i}", chat(f"row {i}")) for i in range(6)]
    staged = StagedOutput(tmp_path / "out.jsonl")
    result = run_batch(lines, model="fake", cache_dir=False, engine=eng, on_line=staged.add)
    staged.publish()
    assert eng.staged == [1, 3, 5]          # the error line at once, then two answers per block before the next
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == [None] + [f"r{i}" for i in range(6)] and rows == result.lines
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_staged_output_refuses_links_and_folders(tmp_path):
    (tmp_path / "real.jsonl").write_text("keep\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "real.jsonl")
    for name in ("link.jsonl", "."):
        with pytest.raises(OutputError, match="not a regular file"):
            StagedOutput(tmp_path / name)
    assert (tmp_path / "real.jsonl").read_text() == "keep\n"


def test_input_lines_split_at_newlines_only(tmp_path, fake):
    text = line("a", chat("one\u2028two")) + "\r\n" + line("b", chat("three\x0cfour")) + "\n"
    (tmp_path / "in.jsonl").write_text(text, newline="")
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "in.jsonl"), "--no-cache"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in result.stdout.split("\n") if x.startswith("{")]
    assert [r["response"]["body"]["choices"][0]["message"]["content"] for r in rows] == \
        ["echo: one\u2028two", "echo: three\x0cfour"]
