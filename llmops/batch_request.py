"""One request line of an OpenAI / vLLM batch file, checked field by field (pydantic, `extra="forbid"`).

A line is `{"custom_id", "method": "POST", "url", "body"}`; `url` is `/v1/chat/completions` (body
`ChatBody`: `messages`) or `/v1/completions` (body `CompletionBody`: `prompt`, one string). Body fields
honoured: `max_tokens` / `max_completion_tokens`, `temperature` (absent: 1.0, as the API), `top_p`, vLLM's
`top_k` (-1 or 0: off), `seed`, `stop`, `logprobs` (chat: true/false with `top_logprobs` 0; completions: 0),
`response_format` (`text`, `json_object`, `json_schema`), vLLM's `guided_json` / `guided_regex` /
`guided_choice` and their current spelling `structured_outputs: {json | regex | choice | json_object}`.
Accepted and not used: `model` (the `--model` given to `llmops batch` serves every line), `user`,
`metadata`, `n: 1`, `stream: false`, zero penalties. Any other field, or a supported one with a value the
engine cannot honour (`n: 2`, `top_logprobs: 5`, a penalty), makes the line an error line naming the field.

Everything is checked before any work: numbers are finite and in range (`NaN`, `Infinity` and booleans are
not numbers), choices are distinct non-empty strings, and a schema or regex is compiled to a grammar
(llguidance, no tokenizer needed) and typed (`llmops.structured.arrow_type`), so a bad line fails alone.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from llmops.core import MapSpec, check_choices, output_type
from llmops.pipeline.spec import check_json_schema, check_regex

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
DEFAULT_MAX_TOKENS = 256
SEED_MAX = 2 ** 63 - 1


class BatchLineError(ValueError):
    """One request line cannot be used; the message names the line (1-based) and the field."""


def _number(value: Any) -> Any:
    """A JSON number that is finite and not a boolean (JSON's true is not 1, NaN and Infinity are no numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {json.dumps(value)}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return value


def _integer(value: Any) -> Any:
    value = _number(value)
    if value != int(value):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def _zero(value: Any) -> Any:
    if _number(value) != 0:
        raise ValueError(f"only 0 is supported (the engine applies no penalty), got {value!r}")
    return value


def _one(value: Any) -> Any:
    if _integer(value) != 1:
        raise ValueError(f"only n=1 (one completion per request line) is supported, got {value!r}")
    return 1


def _chosen_only(value: Any) -> Any:
    if _integer(value) != 0:
        raise ValueError(f"only 0 is supported (the engine reports the chosen token's logprob, no alternatives), "
                         f"got {value!r}")
    return 0


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"expected a non-empty string or a list of non-empty strings, got {json.dumps(value)}")
    return tuple(stops)


def _schema(value: Any) -> dict[str, Any]:
    """A JSON schema object (or its JSON text, as vLLM accepts), compiled and typed here."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON text: {exc.msg}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON schema object, got {type(value).__name__}")
    check_json_schema(value)
    return value


def _choices(value: Any) -> tuple[str, ...]:
    return check_choices(value)


def _regex(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return check_regex(value)


Number = Annotated[float, BeforeValidator(_number)]
Integer = Annotated[int, BeforeValidator(_integer)]
Zero = Annotated[float, BeforeValidator(_zero)]
Stop = Annotated[tuple[str, ...], BeforeValidator(_stop)]
Schema = Annotated[dict[str, Any], BeforeValidator(_schema)]
Choices = Annotated[tuple[str, ...], BeforeValidator(_choices)]
Regex = Annotated[str, BeforeValidator(_regex)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)   # JSON's true is not 1, "true" not true


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    strict: bool | None = None
    schema_: Schema = Field(alias="schema")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (the successor of its guided_* fields); exactly one key."""

    json_: Schema | None = Field(None, alias="json")
    regex: Regex | None = None
    choice: Choices | None = None
    json_object: Literal[True] | None = None


class _Body(_Strict):
    model: str | None = None
    max_tokens: Integer | None = Field(None, ge=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: Integer | None = Field(None, ge=-1)
    seed: Integer | None = Field(None, ge=0, le=SEED_MAX)
    stop: Stop | None = None
    n: Annotated[int, BeforeValidator(_one)] = 1
    stream: Literal[False] = False
    presence_penalty: Zero | None = None
    frequency_penalty: Zero | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    guided_json: Schema | None = None
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    structured_outputs: StructuredOutputs | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: Annotated[int, BeforeValidator(_chosen_only)] | None = None


class CompletionBody(_Body):
    prompt: str
    logprobs: Annotated[int, BeforeValidator(_chosen_only)] | None = None
    echo: Literal[False] = False


class BatchLine(_Strict):
    custom_id: str = Field(min_length=1)
    method: Literal["POST"] = "POST"
    url: Literal["/v1/chat/completions", "/v1/completions"]
    body: dict[str, Any]


@dataclass(frozen=True)
class BatchRequest:
    """One usable request line: its 1-based `line`, `custom_id`, endpoint `url`, the engine `prompt` (data
    parts or chat messages) and the `spec` (sampling, constraints, logprobs; template unused) it runs with."""

    line: int
    custom_id: str
    url: str
    prompt: Any
    spec: MapSpec


def _constraint(body: _Body) -> dict[str, Any]:
    """The MapSpec keyword of the body's one constraint ({} when unconstrained); more than one is an error."""
    found: dict[str, tuple[str, Any]] = {}
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise _FieldError("response_format.json_schema", "required when type is json_schema")
        found["response_format"] = ("schema", fmt.json_schema.schema_)
    elif fmt is not None and fmt.type == "json_object":
        found["response_format"] = ("schema", {"type": "object"})
    for name, key in (("guided_json", "schema"), ("guided_regex", "regex"), ("guided_choice", "choices")):
        if getattr(body, name) is not None:
            found[name] = (key, getattr(body, name))
    so = body.structured_outputs
    if so is not None:
        given = [(n, k, v) for n, k, v in (("json", "schema", so.json_), ("regex", "regex", so.regex),
                                           ("choice", "choices", so.choice),
                                           ("json_object", "schema", {"type": "object"} if so.json_object else None))
                 if v is not None]
        if len(given) != 1:
            raise _FieldError("structured_outputs", "give exactly one of json, regex, choice, json_object; got "
                                                    f"{', '.join(n for n, _, _ in given) or 'none'}")
        found[f"structured_outputs.{given[0][0]}"] = given[0][1:]
    if len(found) > 1:
        raise _FieldError("", f"at most one of response_format, guided_json, guided_regex, guided_choice, "
                              f"structured_outputs may constrain the output, got {', '.join(found)}")
    return dict(found.values())


class _FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"body{'.' + field if field else ''}: {message}")


def _where(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as `a.b[0].c` (the names of union members and validators left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and not any(ch in part for ch in "[(") and part not in ("str", "list"):
            out += f".{part}" if out else part
    return out


def _problem(exc: ValidationError, prefix: str) -> str:
    """The most specific error of a validation (the deepest location: inside a union, the member that got
    furthest) as `prefix.field: message`."""
    err = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
    where = ".".join(p for p in (prefix, _where(tuple(err["loc"]))) if p)
    kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return f"{where}: unknown or unsupported field"
    if kind == "missing":
        return f"{where}: required field is missing"
    if kind == "literal_error" and "input" in err:
        msg = f"{msg}, got {json.dumps(err['input'], default=str)}"
    return f"{where}: {msg}"


def parse_line(text: str, line: int, *, model: str, engine: tuple[tuple[str, Any], ...] = (),
               default_max_tokens: int = DEFAULT_MAX_TOKENS) -> BatchRequest:
    """The request on line `line` (1-based) of a batch file; BatchLineError naming the line and the field."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BatchLineError(f"line {line}: not valid JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise BatchLineError(f"line {line}: not usable JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise BatchLineError(f"line {line}: expected a JSON object, got {type(obj).__name__}")
    try:
        head = BatchLine.model_validate(obj)
    except ValidationError as exc:
        raise BatchLineError(f"line {line}: {_problem(exc, '')}") from None
    chat = head.url == CHAT
    try:
        body = (ChatBody if chat else CompletionBody).model_validate(head.body)
    except ValidationError as exc:
        raise BatchLineError(f"line {line}: {_problem(exc, 'body')}") from None
    except RecursionError:
        raise BatchLineError(f"line {line}: body: a schema nested too deeply or recursive beyond use") from None
    try:
        spec = _spec(body, chat, model, engine, default_max_tokens)
    except (ValueError, TypeError) as exc:
        message = str(exc) if isinstance(exc, _FieldError) else f"body: {exc}"
        raise BatchLineError(f"line {line}: {message}") from None
    except RecursionError:
        raise BatchLineError(f"line {line}: body: a schema nested too deeply to type") from None
    if chat:
        prompt: Any = [{"role": "system" if m.role == "developer" else m.role, "content": [{"data": m.text()}]}
                       for m in body.messages]
    else:
        prompt = [{"data": body.prompt}]
    return BatchRequest(line, head.custom_id, head.url, prompt, spec)


def _spec(body: _Body, chat: bool, model: str, engine: tuple[tuple[str, Any], ...],
          default_max_tokens: int) -> MapSpec:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = bool(body.logprobs) if chat else body.logprobs is not None
    spec = MapSpec(
        template="", model=model, engine=engine, chat=chat, stop=body.stop or (),
        max_new_tokens=max_tokens or default_max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
        seed=body.seed or 0, logprobs=logprobs, **_constraint(body))
    output_type(spec)   # a schema the output cannot be typed by fails this line, not the job
    return spec


def custom_id_of(text: str) -> str | None:
    """The custom_id of a raw line when it has one (for the error line of an unusable request)."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    value = obj.get("custom_id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) else None
