"""OpenAI batch files in and out (`llmops batch`): the request-file format of OpenAI's Batch API and vLLM's
`run_batch`, run on our engine through the result cache and one job plan per group of equal parameters.

Input: one JSON object per line, checked field by field before any work (`llmops.batch_request`: which
body fields are honoured, and why any other is an error). A line that cannot be used (bad JSON, unknown
url or field, a number that is not finite or out of range, a schema or regex that does not compile, a
`custom_id` an earlier line already used) becomes an error line naming its line number and field; every
other line runs. A group of lines whose job fails (the engine raises) becomes error lines for that group
only.

Data is data: each message's content and a completion's prompt reach the engine as `{"data": text}` parts
(llmops.templates), so a control-token string inside a request is ordinary text, never a turn boundary.
Chat requests get the model's chat template; completion prompts do not.

Output: one line per input line, in input order: `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`; `body` is a `chat.completion` (`choices[{index, message{role, content},
finish_reason, logprobs}]`) or a `text_completion` (`choices[{index, text, finish_reason, logprobs}]`), with
`usage{prompt_tokens, completion_tokens, total_tokens}`, `model`, `object`, `created`, `id`. `logprobs`, when
asked for, is OpenAI's shape: chat `{"content": [{"token", "logprob", "bytes", "top_logprobs": []}]}`,
completions `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; else null. An unusable line or a
row the engine failed gives `response` with status 400 / 500 and no body, and `error: {"code", "message"}`
whose message names the line number.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from llmops.batch_request import (CHAT, DEFAULT_MAX_TOKENS, BatchLineError, BatchRequest, custom_id_of,  # noqa: F401
                                  parse_line)
from llmops.core import CacheDir, MapSpec, map_table
from llmops.summary import RunSummary

OnLine = Callable[[int, dict[str, Any]], None]


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


def _rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_line(custom_id: str | None, status: int, code: str, message: str) -> dict[str, Any]:
    """An output line for a request that produced no completion."""
    return {"id": _rid("batch_req"), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": _rid("req"), "body": None},
            "error": {"code": code, "message": message}}


def _token_bytes(token: str) -> list[int] | None:
    """A token's UTF-8 bytes, or None when it decodes to part of a character (shown as U+FFFD)."""
    return None if "\ufffd" in token else list(token.encode("utf-8"))


def _logprobs(req: BatchRequest, pairs: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """OpenAI's `logprobs` object of one choice from the row's (token, logprob) pairs (see module docstring)."""
    if not req.spec.logprobs or pairs is None:
        return None
    if req.url == CHAT:
        return {"content": [{"token": p["token"], "logprob": p["logprob"], "bytes": _token_bytes(p["token"]),
                             "top_logprobs": []} for p in pairs]}
    offsets, at = [], 0
    for p in pairs:
        offsets.append(at)
        at += len(p["token"])
    return {"tokens": [p["token"] for p in pairs], "token_logprobs": [p["logprob"] for p in pairs],
            "top_logprobs": None, "text_offset": offsets}


def response_line(req: BatchRequest, rec: dict[str, Any], model: str, created: int) -> dict[str, Any]:
    """The output line of one request from its `map_table` record (row, text, finish_reason, error,
    prompt_tokens, completion_tokens, and logprobs when asked for)."""
    if rec["finish_reason"] == "error" or rec["text"] is None:
        why = rec["error"] or "no completion was generated"
        return error_line(req.custom_id, 500, "generation_failed", f"line {req.line}: {why}")
    reason = "length" if rec["finish_reason"] == "length" else "stop"
    logprobs = _logprobs(req, rec.get("logprobs"))
    if req.url == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": rec["text"]}, "finish_reason": reason,
                  "logprobs": logprobs}
        obj, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": rec["text"], "finish_reason": reason, "logprobs": logprobs}
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
    """(line number, request or its error output line) for each non-blank line, at most `limit` of them. A
    `custom_id` seen on an earlier line makes the later line an error line. A line the checks cannot
    handle at all still fails alone (its error names the exception)."""
    seen, ids = 0, {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        if limit is not None and seen >= limit:
            return
        seen += 1
        try:
            req = parse_line(text, number, model=model, engine=engine, default_max_tokens=default_max_tokens)
        except BatchLineError as exc:
            yield number, error_line(custom_id_of(text), 400, "invalid_request", str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 (one line never takes the batch down)
            yield number, error_line(custom_id_of(text), 400, "invalid_request",
                                     f"line {number}: unusable request ({type(exc).__name__}: {exc})")
            continue
        if req.custom_id in ids:
            yield number, error_line(req.custom_id, 400, "duplicate_custom_id",
                                     f"line {number}: custom_id {req.custom_id!r} is already used by line "
                                     f"{ids[req.custom_id]}; each request needs its own")
            continue
        ids[req.custom_id] = number
        yield number, req


def run_batch(lines: Iterable[str], *, model: str, engine_settings: tuple[tuple[str, Any], ...] = (),
              default_max_tokens: int = DEFAULT_MAX_TOKENS, limit: int | None = None, cache_dir: CacheDir = None,
              progress: bool | None = None, engine: Any = None, on_line: OnLine | None = None) -> BatchResult:
    """Run every request of a batch file; one job (one plan, one `map_table` call) per group of requests
    with equal sampling parameters and constraints. cache_dir as `map_table` (None: the default result
    cache, False: none). `on_line(line number, output line)` is called for each line as soon as it is
    known (error lines first, then each job's lines as it finishes). Returns the output lines in input
    order."""
    items = list(read_requests(lines, model=model, engine=engine_settings, default_max_tokens=default_max_tokens,
                               limit=limit))
    out: dict[int, dict[str, Any]] = {}

    def put(number: int, obj: dict[str, Any]) -> None:
        out[number] = obj
        if on_line is not None:
            on_line(number, obj)

    groups: dict[MapSpec, list[BatchRequest]] = {}
    for number, item in items:
        if isinstance(item, BatchRequest):
            groups.setdefault(item.spec, []).append(item)
        else:
            put(number, item)
    result, created = BatchResult(), int(time.time())
    for spec, reqs in groups.items():
        table = pa.table({"line": pa.array([r.line for r in reqs], pa.int64())})
        answered: set[int] = set()
        try:
            run = map_table(table, spec, prompts=[r.prompt for r in reqs], cache_dir=cache_dir,
                            progress=progress, engine=engine)
            for batch in run:
                for rec in batch.to_pylist():
                    req = reqs[rec["row"]]
                    answered.add(req.line)
                    put(req.line, response_line(req, rec, model, created))
            result.summary.add(run.summary)
        except Exception as exc:  # noqa: BLE001 (a failed job fails its own lines, not the batch)
            for req in reqs:
                if req.line not in answered:
                    put(req.line, error_line(req.custom_id, 500, "generation_failed",
                                             f"line {req.line}: the job of this line failed: "
                                             f"{type(exc).__name__}: {exc}"))
        result.jobs += 1
    result.lines = [out[n] for n, _ in items]
    return result
