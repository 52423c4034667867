"""OpenAI batch files in and out (`llmops batch`): the request-file format of OpenAI's Batch API and vLLM's
`run_batch`, run on our engine through the result cache and one job plan per group of equal parameters.

Input: one JSON object per line, `{"custom_id", "method": "POST", "url", "body"}`, `url` one of
`/v1/chat/completions` (body `messages`) or `/v1/completions` (body `prompt`, a string). Body fields used:
`max_tokens` / `max_completion_tokens`, `temperature` (absent: 1.0, as the API), `top_p`, `seed`, `stop`
(a string or a list), `response_format` (`{"type": "json_schema", "json_schema": {"schema": ...}}` or
`{"type": "json_object"}`: constrained decoding), vLLM's `guided_json` / `guided_choice` / `guided_regex`;
`n` must be 1; `model` is echoed in nothing (the `--model` given to `llmops batch` serves every line, as one
vLLM server does); other fields (`user`, `metadata`, `logprobs`...) are ignored.

Data is data: each message's content (a string, or `[{"type": "text", "text": ...}]` parts) and a
completion's prompt reach the engine as `{"data": text}` parts (llmops.templates), so a control-token
string inside a request is ordinary text, never a turn boundary. Chat requests get the model's chat
template; completion prompts do not.

Output: one line per input line, in input order: `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`; `body` is a `chat.completion` (`choices[{index, message{role, content},
finish_reason, logprobs}]`) or a `text_completion` (`choices[{index, text, finish_reason, logprobs}]`), with
`usage{prompt_tokens, completion_tokens, total_tokens}`, `model`, `object`, `created`, `id`. A line that
cannot be used (bad JSON, unknown url, missing field) or a row the engine failed gives `response` with
status 400 / 500 and no body, and `error: {"code", "message"}` whose message names the line number.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from llmops.core import CacheDir, MapSpec, map_table, output_type
from llmops.summary import RunSummary

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ROLES = ("system", "user", "assistant", "developer")
DEFAULT_MAX_TOKENS = 256


class BatchLineError(ValueError):
    """One request line cannot be used; the message names the line (1-based) and the field."""


@dataclass(frozen=True)
class BatchRequest:
    """One usable request line: its 1-based `line`, `custom_id`, endpoint `url`, the engine `prompt` (data
    parts or chat messages) and the `spec` (sampling and constraints; template unused) it runs with."""

    line: int
    custom_id: str
    url: str
    prompt: Any
    spec: MapSpec


@dataclass
class BatchResult:
    """What `run_batch` did: `lines` output objects in input order and the figures of every job."""

    lines: list[dict[str, Any]] = field(default_factory=list)
    summary: RunSummary = field(default_factory=lambda: RunSummary(calls=0))
    jobs: int = 0

    @property
    def failed(self) -> int:
        """Lines whose output carries an error."""
        return sum(1 for o in self.lines if o["error"] is not None)


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BatchLineError(f"{where}[{i}]: only text content parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise BatchLineError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BatchLineError("body.messages: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise BatchLineError(f"body.messages[{i}].role: expected one of {', '.join(ROLES)}, got {role!r}")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": [{"data": _content_text(m.get("content"), f"body.messages[{i}].content")}]})
    return out


def _number(body: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise BatchLineError(f"body.{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _constraint(body: dict[str, Any]) -> dict[str, Any]:
    """MapSpec keyword for the body's response_format / guided_* fields ({} when unconstrained)."""
    fmt = body.get("response_format")
    found: dict[str, Any] = {}
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
            if not isinstance(schema, dict):
                raise BatchLineError("body.response_format.json_schema.schema: expected a JSON schema object")
            found["schema"] = schema
        elif kind == "json_object":
            found["schema"] = {"type": "object"}
        elif kind != "text":
            raise BatchLineError(f"body.response_format.type: expected json_schema, json_object or text, got {kind!r}")
    for key, name in (("guided_json", "schema"), ("guided_choice", "choices"), ("guided_regex", "regex")):
        if body.get(key) is not None:
            found[name] = tuple(body[key]) if name == "choices" else body[key]
    if len(found) > 1:
        raise BatchLineError(f"body: at most one of response_format, guided_json, guided_choice, guided_regex "
                             f"may be given, got {', '.join(sorted(found))}")
    return found


def parse_line(text: str, line: int, *, model: str, engine: tuple[tuple[str, Any], ...] = (),
               default_max_tokens: int = DEFAULT_MAX_TOKENS) -> BatchRequest:
    """The request on line `line` (1-based) of a batch file; BatchLineError naming the line and field."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BatchLineError(f"line {line}: not valid JSON: {exc.msg} at column {exc.colno}") from None
    try:
        if not isinstance(obj, dict):
            raise BatchLineError(f"expected a JSON object, got {type(obj).__name__}")
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchLineError("custom_id: expected a non-empty string")
        if obj.get("method", "POST") != "POST":
            raise BatchLineError(f"method: expected POST, got {obj.get('method')!r}")
        url, body = obj.get("url"), obj.get("body")
        if url not in (CHAT, COMPLETIONS):
            raise BatchLineError(f"url: expected {CHAT} or {COMPLETIONS}, got {url!r}")
        if not isinstance(body, dict):
            raise BatchLineError("body: expected a JSON object")
        if body.get("n", 1) != 1:
            raise BatchLineError(f"body.n: only n=1 is supported, got {body.get('n')!r}")
        if body.get("tools") or body.get("functions"):
            raise BatchLineError("body.tools: tool calls are not supported")
        if url == CHAT:
            prompt: Any = _messages(body)
        elif isinstance(body.get("prompt"), str):
            prompt = [{"data": body["prompt"]}]
        else:
            raise BatchLineError("body.prompt: expected a string (one prompt per request line)")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise BatchLineError(f"body.stop: expected a string or a list of strings, got {body.get('stop')!r}")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        try:
            spec = MapSpec(
                template="", model=model, engine=engine, chat=url == CHAT or False, stop=tuple(stop),
                max_new_tokens=_number({key: max_tokens}, key, default_max_tokens, int),
                temperature=_number(body, "temperature", 1.0, float), top_p=_number(body, "top_p", 1.0, float),
                seed=_number(body, "seed", 0, int), **_constraint(body))
            output_type(spec)   # a schema the output column cannot type fails this line, not the job
        except (ValueError, TypeError) as exc:
            if isinstance(exc, BatchLineError):
                raise
            raise BatchLineError(f"body: {exc}") from None
        return BatchRequest(line, custom_id, url, prompt, spec)
    except BatchLineError as exc:
        if str(exc).startswith(f"line {line}:"):
            raise
        raise BatchLineError(f"line {line}: {exc}") from None


def custom_id_of(text: str) -> str | None:
    """The custom_id of a raw line when it has one (for the error line of an unusable request)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    value = obj.get("custom_id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) else None


def _rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_line(custom_id: str | None, status: int, code: str, message: str) -> dict[str, Any]:
    """An output line for a request that produced no completion."""
    return {"id": _rid("batch_req"), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": _rid("req"), "body": None},
            "error": {"code": code, "message": message}}


def response_line(req: BatchRequest, rec: dict[str, Any], model: str, created: int) -> dict[str, Any]:
    """The output line of one request from its `map_table` record (row, text, finish_reason, error,
    prompt_tokens, completion_tokens)."""
    if rec["finish_reason"] == "error" or rec["text"] is None:
        why = rec["error"] or "no completion was generated"
        return error_line(req.custom_id, 500, "generation_failed", f"line {req.line}: {why}")
    reason = "length" if rec["finish_reason"] == "length" else "stop"
    if req.url == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": rec["text"]}, "finish_reason": reason,
                  "logprobs": None}
        obj, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": rec["text"], "finish_reason": reason, "logprobs": None}
        obj, prefix = "text_completion", "cmpl"
    usage = {"prompt_tokens": int(rec["prompt_tokens"] or 0), "completion_tokens": int(rec["completion_tokens"] or 0)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    body = {"id": _rid(prefix), "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage}
    return {"id": _rid("batch_req"), "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": _rid("req"), "body": body}, "error": None}


def read_requests(lines: Iterable[str], *, model: str, engine: tuple[tuple[str, Any], ...] = (),
                  default_max_tokens: int = DEFAULT_MAX_TOKENS, limit: int | None = None,
                  ) -> Iterator[tuple[int, BatchRequest | dict[str, Any]]]:
    """(line number, request or its error output line) for each non-blank line, at most `limit` of them."""
    seen = 0
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        if limit is not None and seen >= limit:
            return
        seen += 1
        try:
            yield number, parse_line(text, number, model=model, engine=engine, default_max_tokens=default_max_tokens)
        except BatchLineError as exc:
            yield number, error_line(custom_id_of(text), 400, "invalid_request", str(exc))


def run_batch(lines: Iterable[str], *, model: str, engine_settings: tuple[tuple[str, Any], ...] = (),
              default_max_tokens: int = DEFAULT_MAX_TOKENS, limit: int | None = None, cache_dir: CacheDir = None,
              progress: bool | None = None, engine: Any = None) -> BatchResult:
    """Run every request of a batch file; one job (one plan, one `map_table` call) per group of requests
    with equal sampling parameters and constraints. cache_dir as `map_table` (None: the default result
    cache, False: none). Returns the output lines in input order."""
    items = list(read_requests(lines, model=model, engine=engine_settings, default_max_tokens=default_max_tokens,
                               limit=limit))
    out: dict[int, dict[str, Any]] = {n: item for n, item in items if isinstance(item, dict)}
    groups: dict[MapSpec, list[BatchRequest]] = {}
    for _, item in items:
        if isinstance(item, BatchRequest):
            groups.setdefault(item.spec, []).append(item)
    result, created = BatchResult(), int(time.time())
    for spec, reqs in groups.items():
        table = pa.table({"line": pa.array([r.line for r in reqs], pa.int64())})
        run = map_table(table, spec, prompts=[r.prompt for r in reqs], cache_dir=cache_dir,
                        progress=progress, engine=engine)
        for rec in run.ordered().to_pylist():
            req = reqs[rec["row"]]
            out[req.line] = response_line(req, rec, model, created)
        result.summary.add(run.summary)
        result.jobs += 1
    result.lines = [out[n] for n, _ in items]
    return result
