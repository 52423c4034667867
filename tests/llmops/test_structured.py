"""Schemas in every spelling -> JSON schema -> Arrow types; typed parsing of finished outputs."""
from __future__ import annotations

from typing import Optional

import polars as pl
import pyarrow as pa
import pydantic
import pytest

from llmops.structured import arrow_type, coerce, parse_json_output, to_json_schema


class Address(pydantic.BaseModel):
    city: str
    zip: Optional[int] = None


class Invoice(pydantic.BaseModel):
    number: str
    total: float
    paid: bool
    lines: list[str]
    billing: Address


def test_mapping_of_types_is_a_strict_object():
    schema = to_json_schema({"city": str, "n": int, "x": float, "ok": bool, "name": "string"})
    assert schema["required"] == ["city", "n", "x", "ok", "name"]
    assert schema["additionalProperties"] is False
    assert arrow_type(schema) == pa.struct([("city", pa.string()), ("n", pa.int64()), ("x", pa.float64()),
                                            ("ok", pa.bool_()), ("name", pa.string())])


def test_polars_dtypes():
    schema = to_json_schema(pl.Struct({"id": pl.Int32, "amount": pl.Float64, "tags": pl.List(pl.String),
                                       "kind": pl.Enum(["a", "b"]), "inner": pl.Struct({"z": pl.Boolean})}))
    assert schema["properties"]["kind"] == {"type": "string", "enum": ["a", "b"]}
    assert arrow_type(schema) == pa.struct([
        ("id", pa.int64()), ("amount", pa.float64()), ("tags", pa.list_(pa.string())), ("kind", pa.string()),
        ("inner", pa.struct([("z", pa.bool_())]))])
    assert to_json_schema({"order_id": pl.String, "amount": pl.Float64})["properties"]["amount"] == {"type": "number"}
    assert to_json_schema(pl.Schema({"a": pl.Int8}))["properties"] == {"a": {"type": "integer"}}


def test_pydantic_model_with_refs_and_optional():
    schema = to_json_schema(Invoice)
    assert arrow_type(schema) == pa.struct([
        ("number", pa.string()), ("total", pa.float64()), ("paid", pa.bool_()), ("lines", pa.list_(pa.string())),
        ("billing", pa.struct([("city", pa.string()), ("zip", pa.int64())]))])


def test_json_schema_passthrough_and_fallbacks():
    raw = {"type": "object", "properties": {"a": {"type": ["integer", "null"]}, "free": {"type": "object"},
                                            "u": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}
    assert to_json_schema(raw) == raw and to_json_schema(raw) is not raw
    assert arrow_type(raw) == pa.struct([("a", pa.int64()), ("free", pa.string()), ("u", pa.string())])


@pytest.mark.parametrize("bad", [{"a": complex}, {}, 42, [str]])
def test_unsupported_schemas(bad):
    with pytest.raises(TypeError):
        to_json_schema(bad)


def test_parse_and_coerce():
    typ = arrow_type(to_json_schema(Invoice))
    text = '{"number": "A1", "total": 3, "paid": false, "lines": ["x"], "billing": {"city": "Oslo", "zip": null}}'
    value = parse_json_output(text, {}, typ)
    assert value == {"number": "A1", "total": 3.0, "paid": False, "lines": ["x"],
                     "billing": {"city": "Oslo", "zip": None}}
    assert isinstance(value["total"], float)
    pa.array([value], type=typ)
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_json_output('{"number": ', {}, typ)
    with pytest.raises(ValueError, match=r"\$.billing.zip: expected an integer"):
        coerce({"billing": {"zip": 1.5}}, typ)
    with pytest.raises(ValueError, match=r"\$.paid: expected a boolean"):
        coerce({"paid": "yes"}, typ)
    assert coerce({"x": 1}, pa.string()) == '{"x": 1}'
