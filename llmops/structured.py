"""Structured output: schemas in many spellings -> one JSON schema -> an Arrow type and typed values.

`to_json_schema` accepts a JSON schema (dict with "type"/"properties"/"$ref"...), a mapping of field name to
a type (Polars dtype, Python type or a JSON type name: `{"amount": pl.Float64, "city": str}`), a Polars
`Struct`/`Schema`, or a pydantic model class. Schemas built here are strict objects (every property
required, no extra properties) so the engine's constrained decoding yields every field. `arrow_type`
maps a JSON schema to the Arrow type of the output column and `parse_json_output` turns a finished
generation into a value of that type (raising ValueError naming the field at fault).

The grammar and the parser agree: every JSON text the grammar of `decoding_schema(schema)` allows parses into
the column. An `integer` is int64, so the grammar bounds integers to that range (`INT_BOUND`); a `number` is
float64, and a JSON number beyond its range is the float64 it rounds to, +-inf, as JSON parsers round it
(the grammar allows any exponent). NaN and Infinity are no JSON values and never parse.
Nothing here imports polars or pydantic eagerly.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NoReturn

import pyarrow as pa

_NAMES = {
    "string": "string", "str": "string", "utf8": "string", "text": "string", "varchar": "string",
    "integer": "integer", "int": "integer", "int64": "integer", "bigint": "integer",
    "number": "number", "float": "number", "float64": "number", "double": "number",
    "boolean": "boolean", "bool": "boolean",
}
# The widest integer bounds the grammar compiler (llguidance) takes: it reads bounds as float64, where int64's
# own limits round to 2**63, out of its range; 2**63 - 1024 is the largest float64 below 2**63.
INT_BOUND = 2**63 - 1024
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_NODES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _is_json_schema(d: Mapping[str, Any]) -> bool:
    return any(k in d for k in ("type", "properties", "$ref", "anyOf", "oneOf", "enum", "$defs"))


def _from_python_type(tp: Any, where: str) -> dict[str, Any]:
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if isinstance(tp, str) and tp.lower() in _NAMES:
        return {"type": _NAMES[tp.lower()]}
    if isinstance(tp, Mapping):
        return to_json_schema(tp)
    raise TypeError(f"schema field {where!r}: unsupported type {tp!r} (use str, int, float, bool, a Polars "
                    "dtype or a nested mapping)")


def _from_polars_dtype(dtype: Any, where: str) -> dict[str, Any]:
    import polars as pl  # optional dependency: only Polars dtypes reach here

    if isinstance(dtype, type):
        dtype = dtype()
    if isinstance(dtype, pl.Enum):
        return {"type": "string", "enum": list(dtype.categories)}
    if isinstance(dtype, pl.Struct):
        return _strict_object({f.name: _from_polars_dtype(f.dtype, f"{where}.{f.name}") for f in dtype.fields})
    if isinstance(dtype, (pl.List, pl.Array)):
        return {"type": "array", "items": _from_polars_dtype(dtype.inner, f"{where}[]")}
    if dtype.is_integer():
        return {"type": "integer"}
    if dtype.is_float() or dtype.is_decimal():
        return {"type": "number"}
    if isinstance(dtype, pl.Boolean):
        return {"type": "boolean"}
    if isinstance(dtype, (pl.String, pl.Categorical)):
        return {"type": "string"}
    if isinstance(dtype, pl.Date):
        return {"type": "string", "format": "date"}
    raise TypeError(f"schema field {where!r}: Polars dtype {dtype} has no JSON-schema equivalent here")


def _is_polars(obj: Any) -> bool:
    mod = (obj if isinstance(obj, type) else type(obj)).__module__
    return mod.startswith("polars")


def _strict_object(properties: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def to_json_schema(schema: Any) -> dict[str, Any]:
    """Normalize any supported schema spelling to a JSON schema dict (see module docstring)."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return schema.model_json_schema()
    if _is_polars(schema):
        import polars as pl  # optional dependency: only a Polars schema reaches here

        if isinstance(schema, pl.Schema):
            return _strict_object({k: _from_polars_dtype(v, k) for k, v in schema.items()})
        return _from_polars_dtype(schema, "$")
    if isinstance(schema, Mapping):
        if _is_json_schema(schema):
            return json.loads(json.dumps(schema))
        props = {}
        for name, tp in schema.items():
            props[str(name)] = _from_polars_dtype(tp, name) if _is_polars(tp) else _from_python_type(tp, name)
        if not props:
            raise TypeError("schema has no fields")
        return _strict_object(props)
    raise TypeError(f"unsupported schema {schema!r}: give a JSON schema dict, a mapping of field -> type, a "
                    "Polars Struct or a pydantic model class")


def _resolve(node: dict[str, Any], root: dict[str, Any], refs: tuple[str, ...] = ()) -> tuple[dict[str, Any],
                                                                                            tuple[str, ...]]:
    """`node` with its `$ref` chain followed, and `refs` grown by the references followed. ValueError for a
    reference that is not local or points at nothing."""
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"schema $ref {ref!r}: only local references ('#/...') are supported")
        if ref in refs:
            return {"$recursive": ref}, refs
        target: Any = root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"schema $ref {ref!r} points at nothing (no {part!r} in the schema)")
            target = target[part]
        if not isinstance(target, dict):
            raise ValueError(f"schema $ref {ref!r} points at a {type(target).__name__}, not a schema")
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        refs += (ref,)
    if not isinstance(node, dict):
        raise ValueError(f"schema node {node!r} is not a JSON schema object")
    return node, refs


def _non_null_variants(node: dict[str, Any]) -> list[dict[str, Any]] | None:
    for key in ("anyOf", "oneOf"):
        if key in node:
            return [v for v in node[key] if not (isinstance(v, dict) and v.get("type") == "null")]
    return None


def arrow_type(schema: dict[str, Any], _root: dict[str, Any] | None = None,
               _refs: tuple[str, ...] = ()) -> pa.DataType:
    """The Arrow type of values matching JSON schema `schema` (nullable everywhere). Untyped nodes,
    free-form objects, unions of several types and a recursive reference (a node inside its own definition)
    become strings holding JSON text. ValueError for a `$ref` that points at nothing."""
    root = _root if _root is not None else schema
    node, refs = _resolve(schema, root, _refs)
    if "$recursive" in node:
        return pa.string()
    variants = _non_null_variants(node)
    if variants is not None:
        return arrow_type(variants[0], root, refs) if len(variants) == 1 else pa.string()
    kind = node.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None and isinstance(node.get("enum"), list):
        kind = "string" if all(isinstance(v, str) for v in node["enum"]) else None
    if kind is None and "properties" in node:
        kind = "object"
    if kind == "object" and isinstance(node.get("properties"), dict) and node["properties"]:
        return pa.struct([pa.field(k, arrow_type(v, root, refs)) for k, v in node["properties"].items()])
    if kind == "array" and isinstance(node.get("items"), dict):
        return pa.list_(arrow_type(node["items"], root, refs))
    return {"integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}.get(kind, pa.string())


def coerce(value: Any, typ: pa.DataType, where: str = "$") -> Any:
    """Convert a decoded JSON value to a Python value Arrow accepts for `typ`; ValueError names `where`."""
    if value is None:
        return None
    if pa.types.is_struct(typ):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        return {f.name: coerce(value.get(f.name), f.type, f"{where}.{f.name}") for f in typ}
    if pa.types.is_list(typ):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected an array, got {type(value).__name__}")
        return [coerce(v, typ.value_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if pa.types.is_boolean(typ):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected a boolean, got {value!r}")
        return value
    if pa.types.is_integer(typ):
        number = _integral(value)
        low, high = _int_range(typ)
        if number is None or not low <= number <= high:
            raise ValueError(f"{where}: expected an integer in [{low}, {high}], got {_short(value)}")
        return number
    if pa.types.is_floating(typ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:     # NaN
            raise ValueError(f"{where}: expected a number, got {_short(value)}")
        return _to_float(value)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _integral(value: Any) -> int | None:
    """`value` as an int when it is a whole number (an int, or a float with no fraction), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _int_range(typ: pa.DataType) -> tuple[int, int]:
    """The smallest and largest value of Arrow integer type `typ`."""
    bits = typ.bit_width
    if pa.types.is_signed_integer(typ):
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def _to_float(value: int | float) -> float:
    """The float64 a JSON number rounds to: +-inf beyond float64's range (an int too large for float())."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _short(value: Any) -> str:
    """`repr(value)`, cut to 80 characters (a generated integer may have hundreds of digits)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _not_json(name: str) -> NoReturn:
    raise ValueError(f"output is not valid JSON ({name} is not a JSON value)")


def parse_json_output(text: str, schema: dict[str, Any], typ: pa.DataType) -> Any:
    """Parse a finished generation into a value of Arrow type `typ` (see `arrow_type(schema)`). ValueError when
    `text` is not JSON (Python's NaN / Infinity literals included) or does not fit `typ`."""
    try:
        value = json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"output is not valid JSON ({exc.msg} at char {exc.pos})") from None
    return coerce(value, typ)


def decoding_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema constrained decoding uses for `schema`: a copy in which every node whose values become
    int64 (`type` integer, or integer and null) is bounded to [-INT_BOUND, INT_BOUND] (tighter bounds of its
    own stay), so every integer the grammar allows fits the column. Subschemas are followed through
    properties, items, $defs, anyOf/oneOf/allOf and the other keywords that hold schemas."""
    return _bound_integers(schema)


def _bound_integers(node: Any) -> Any:
    """`node` (a schema, a list of schemas or any other value) with its int64 nodes bounded, as a copy."""
    if isinstance(node, list):
        return [_bound_integers(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _bound_integers(sub) for name, sub in out[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMA_NODES):
        if key in out:
            out[key] = _bound_integers(out[key])
    kind = out.get("type")
    kinds = [k for k in kind if k != "null"] if isinstance(kind, list) else [kind]
    if kinds == ["integer"]:
        for key, bound, tighter in (("minimum", -INT_BOUND, max), ("maximum", INT_BOUND, min)):
            given = out.get(key)
            if given is None:
                out[key] = bound
            elif isinstance(given, (int, float)) and not isinstance(given, bool):
                out[key] = tighter(given, bound)
    return out
