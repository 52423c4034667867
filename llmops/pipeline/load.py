"""Load a pipeline YAML file into a validated `Pipeline`, with errors that name file, line and key.

YAML is read with a `yaml.SafeLoader` subclass whose mappings and sequences remember the line of each
key / item (`LineDict`, `LineList`); duplicate keys are errors (plain YAML keeps the last silently).
A pydantic error's location is walked through that data to find the line, and through the schema to
say what was expected (e.g. the allowed keys for an unknown one). Every failure raises `PipelineError`.

Relative paths in the file (`PATH_KEYS`: source and sink files and databases, `cache_dir`,
`engine.disk_dir`) are relative to the file's folder, so a pipeline runs the same from any working directory;
they are made absolute when the file is loaded. A path from the environment (`${VAR}`) is taken as the
environment gives it (relative to the working directory if relative), like `--set` values; the default of a
path that is one `${VAR:-default}` is written in the file, so it is relative to the file's folder. Paths
inside SQL text are DuckDB's own (relative to the working directory).
"""
from __future__ import annotations

import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from llmops.pipeline.spec import Pipeline


class PipelineError(ValueError):
    """An invalid pipeline (a job-level error: the CLI exits 2). `problems` lists one line per error,
    each `file:line: key.path: message`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid pipeline:\n  " + "\n  ".join(problems))


class LineDict(dict):
    """A dict that knows the 1-based line of each key (`key_lines`) and of itself (`line`)."""
    line: int = 0
    key_lines: dict[Any, int]


class LineList(list):
    """A list that knows the 1-based line of each item (`item_lines`) and of itself (`line`)."""
    line: int = 0
    item_lines: list[int]


class _LineLoader(yaml.SafeLoader):
    pass


def _construct_map(loader: _LineLoader, node: yaml.MappingNode) -> LineDict:
    loader.flatten_mapping(node)
    out, lines = LineDict(), {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in lines:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {lines[key]})", key_node.start_mark)
        lines[key] = key_node.start_mark.line + 1
        out[key] = loader.construct_object(value_node, deep=True)
    out.key_lines, out.line = lines, node.start_mark.line + 1
    return out


def _construct_seq(loader: _LineLoader, node: yaml.SequenceNode) -> LineList:
    out = LineList(loader.construct_object(child, deep=True) for child in node.value)
    out.item_lines, out.line = [child.start_mark.line + 1 for child in node.value], node.start_mark.line + 1
    return out


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_seq)


def parse_yaml(text: str, *, filename: str = "<string>") -> Any:
    """Parse YAML safely into LineDict/LineList/scalars; a syntax error raises PipelineError with its line."""
    try:
        return yaml.load(text, Loader=_LineLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else filename
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        raise PipelineError([f"{where}: YAML syntax error: {problem}"]) from None
    except yaml.YAMLError as exc:
        raise PipelineError([f"{filename}: YAML error: {exc}"]) from None


def locate(data: Any, loc: tuple) -> tuple[int | None, str]:
    """The line of the deepest part of `loc` present in `data`, and `loc` as a readable key path.

    Parts absent from the data (pydantic repeats a union's tag: steps.0.llm_map.llm_map) are skipped."""
    line, node, path, previous = getattr(data, "line", None), data, "", None
    for part in loc:
        if part == previous:
            continue
        previous = part
        if isinstance(node, LineDict) and part in node:
            line, node = node.key_lines.get(part, line), node[part]   # a key added by --set has no line
            path += f".{part}" if path else str(part)
        elif isinstance(node, LineList) and isinstance(part, int) and 0 <= part < len(node):
            line, node = node.item_lines[part], node[part]
            path += f"[{part}]"
        elif isinstance(node, (LineDict, LineList)) and isinstance(part, str):
            path += f".{part}" if path else part
    return line, path or "(top level)"


def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _tag_of(tp: Any) -> str | None:
    if typing.get_origin(tp) is typing.Annotated:
        return next((getattr(m, "tag") for m in typing.get_args(tp)[1:] if hasattr(m, "tag")), None)
    return None


def expected_keys(model: type[BaseModel], loc: tuple) -> list[str] | None:
    """The keys allowed in the mapping at `loc` (walking fields, lists and tagged unions), or None."""
    tp: Any = model
    for part in loc:
        tp = _strip_annotated(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            by_key = {(f.alias or name): f for name, f in tp.model_fields.items()}
            if part not in by_key:
                return None
            tp = by_key[part].annotation
            continue
        args = typing.get_args(tp)
        if typing.get_origin(tp) in (list, LineList) and isinstance(part, int):
            tp = args[0]
        elif typing.get_origin(tp) is dict:
            tp = args[1]
        elif args:
            tagged = [a for a in args if _tag_of(a) == part]
            models = [_strip_annotated(a) for a in args if isinstance(_strip_annotated(a), type)
                      and issubclass(_strip_annotated(a), BaseModel)]
            if tagged:
                tp = tagged[0]
            elif len(models) == 1:
                tp = models[0]
                by_key = {(f.alias or name): f for name, f in tp.model_fields.items()}
                if part not in by_key:
                    return None
                tp = by_key[part].annotation
            else:
                return None
        else:
            return None
    tp = _strip_annotated(tp)
    args = [_strip_annotated(a) for a in typing.get_args(tp)] or [tp]
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(models) != 1:
        return None
    return sorted((f.alias or name) for name, f in models[0].model_fields.items())


def _message(err: dict, model: type[BaseModel]) -> str:
    kind, loc = err["type"], err["loc"]
    if kind == "extra_forbidden":
        allowed = expected_keys(model, loc[:-1])
        hint = f"; expected one of: {', '.join(allowed)}" if allowed else ""
        return f"unknown key {loc[-1]!r}{hint}"
    if kind == "missing":
        return f"missing required key {loc[-1]!r}"
    if kind == "invalid_step":
        got = list(err["input"]) if isinstance(err["input"], dict) else type(err["input"]).__name__
        return f"{err['msg']}; got {got}"
    msg = err["msg"].removeprefix("Value error, ")
    if kind not in ("value_error", "assertion_error") and not isinstance(err.get("input"), (dict, list)):
        msg += f" (got {err['input']!r})"
    return msg


def _dotted(path: str) -> str:
    return re.sub(r"\[(\d+)\]", r".\1", path)


def validation_problems(exc: ValidationError, data: Any, filename: str, overrides: list[str] = ()) -> list[str]:
    """One `file:line: key.path: message` string per pydantic error; an error at (or under) a key set by an
    override says `--set ITEM` instead of the file's line."""
    located = []
    for err in exc.errors():
        line, path = locate(data, tuple(err["loc"]))
        where = f"{filename}:{line}" if line else filename
        dotted = _dotted(path)
        for item in overrides:
            key = item.partition("=")[0]
            if dotted == key or dotted.startswith(key + ".") or key.startswith(dotted + "."):
                where, line = f"--set {item}", 0
        located.append((line or 0, f"{where}: {path}: {_message(err, Pipeline)}"))
    return [text for _, text in sorted(located, key=lambda item: item[0])]


def apply_overrides(data: Any, overrides: list[str]) -> None:
    """Apply `KEY.PATH=VALUE` overrides in place (VALUE parsed as YAML; list items by index:
    `steps.1.llm_map.max_new_tokens=8`). A malformed override raises PipelineError."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise PipelineError([f"--set {item!r}: expected KEY.PATH=VALUE"])
        parts, node = key.split("."), data
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise PipelineError([f"--set {item!r}: {'.'.join(parts[:i]) or 'top'} has no item {part!r}"])
                part = int(part)
            elif not isinstance(node, dict):
                raise PipelineError([f"--set {item!r}: {'.'.join(parts[:i])} is not a mapping"])
            if last:
                node[part] = yaml.safe_load(raw)
            else:
                if isinstance(node, dict) and part not in node:
                    node[part] = {}
                node = node[part]


PATH_KEYS = (("source", "csv"), ("source", "parquet"), ("source", "jsonl"), ("source", "database"),
             ("sink", "parquet"), ("sink", "csv"), ("sink", "jsonl"), ("sink", "database"), ("cache_dir",),
             ("engine", "disk_dir"))


_DEFAULTED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}")


def rebase_paths(data: Any, folder: Path) -> None:
    """Make the relative paths at `PATH_KEYS` of a parsed pipeline absolute, relative to `folder` (the
    file's), and the relative default of a path that is one `${VAR:-default}`; absolute paths, other paths
    with a `${VAR}` and values that are not strings are left as they are."""
    def rebase(path: str) -> str:
        return path if os.path.isabs(path) else os.path.normpath(os.path.join(os.path.abspath(folder), path))

    for keys in PATH_KEYS:
        node = data
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        value = node.get(keys[-1]) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value.strip():
            continue
        defaulted = _DEFAULTED.fullmatch(value)
        if defaulted is not None and defaulted.group(2):
            node[keys[-1]] = f"${{{defaulted.group(1)}:-{rebase(defaulted.group(2))}}}"
        elif "${" not in value:
            node[keys[-1]] = rebase(value)


def load_pipeline(path: str | Path, *, overrides: list[str] = ()) -> Pipeline:
    """Read and validate a pipeline YAML file (its relative paths are relative to its folder, see the module
    docstring). Raises PipelineError (file/line/key in each problem)."""
    filename = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PipelineError([f"{filename}: cannot read pipeline file: {exc.strerror}"]) from None
    data = parse_yaml(text, filename=filename)
    if not isinstance(data, dict):
        raise PipelineError([f"{filename}:1: a pipeline is a mapping with keys source, steps, sink; "
                             f"got {type(data).__name__}"])
    rebase_paths(data, Path(path).parent)
    apply_overrides(data, list(overrides))
    try:
        pipeline = Pipeline.from_dict(data)
    except ValidationError as exc:
        raise PipelineError(validation_problems(exc, data, filename, list(overrides))) from None
    _check_sink_path(pipeline, data, filename)
    return pipeline


def _check_sink_path(pipeline: Pipeline, data: Any, filename: str) -> None:
    """A sink that names a directory is refused at load (file:line), before anything is read."""
    sink = pipeline.sink
    key = "database" if sink.kind == "database" else sink.kind
    target = Path(getattr(sink, key))
    if target.is_dir():
        line, path = locate(data, ("sink", key))
        raise PipelineError([f"{filename}:{line or 1}: {path}: {target} is a directory; name the file to write "
                             f"(e.g. {target / ('out.' + (sink.kind if sink.kind != 'database' else 'duckdb'))})"])


_STEP_PREFIX = re.compile(r"^steps\[(\d+)\] \((\w+)\): ")
_PART_PREFIX = re.compile(r"^(source|sink)\.(\w+): ")


def locate_error(path: str | Path, message: str) -> str:
    """`message` (a SourceError / StepError / TemplateError raised while running or planning the pipeline
    at `path`, which names `steps[i] (kind)` or `source.key` / `sink.key`) prefixed with `file:line` of
    that place: a template error points at the step's `template` line. Unchanged when nothing matches or
    the file cannot be read again."""
    step, part = _STEP_PREFIX.match(message), _PART_PREFIX.match(message)
    if step is None and part is None:
        return message
    try:
        data = parse_yaml(Path(path).read_text(encoding="utf-8"), filename=str(path))
    except (OSError, PipelineError):
        return message
    if step is not None:
        loc: tuple = ("steps", int(step.group(1)), step.group(2))
        if "template" in message:
            loc += ("template",)
    else:
        loc = (part.group(1), part.group(2))
    line, _ = locate(data, loc)
    return f"{path}:{line}: {message}" if line else message


def dump_pipeline(pipeline: Pipeline) -> str:
    """The pipeline as YAML (defaults omitted); `load_pipeline` of it gives an equal Pipeline."""
    return yaml.safe_dump(pipeline.to_dict(), sort_keys=False, allow_unicode=True, width=110)

