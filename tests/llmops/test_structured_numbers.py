"""Numbers at the edges of their columns: what `parse_json_output` makes of every JSON number the grammar
allows, and the integer bounds `decoding_schema` gives the grammar."""
from __future__ import annotations

import copy
import math

import pyarrow as pa
import pytest

from llmops.pipeline.spec import check_json_schema
from llmops.structured import INT_BOUND, arrow_type, decoding_schema, parse_json_output, to_json_schema

SCHEMA = to_json_schema({"n": "integer", "x": "number"})
TYPE = arrow_type(SCHEMA)


@pytest.mark.parametrize("x, expected", [
    ("1e999", math.inf), ("-1E+999", -math.inf), ("1" + "0" * 400, math.inf), ("-" + "9" * 400, -math.inf),
    ("0.90696644281666879e41908003", math.inf), ("1e-999", 0.0), ("-0", 0.0),
    ("1.7976931348623157e308", 1.7976931348623157e308), ("1240.50", 1240.5),
])
def test_a_number_parses_to_the_float64_it_rounds_to(x, expected):
    value = parse_json_output(f'{{"n": 1, "x": {x}}}', SCHEMA, TYPE)
    assert value["x"] == expected and isinstance(value["x"], float)
    assert pa.array([value], TYPE).null_count == 0


@pytest.mark.parametrize("n, expected", [
    (str(2**63 - 1), 2**63 - 1), (str(-2**63), -2**63), ("-0", 0), ("3", 3),
])
def test_an_integer_inside_int64_parses(n, expected):
    value = parse_json_output(f'{{"n": {n}, "x": 1}}', SCHEMA, TYPE)
    assert value["n"] == expected
    assert pa.array([value], TYPE).to_pylist() == [{"n": expected, "x": 1.0}]


@pytest.mark.parametrize("text, message", [
    ('{"n": 9223372036854775808, "x": 1}',
     r"\$\.n: expected an integer in \[-9223372036854775808, 9223372036854775807\]"),
    ('{"n": -' + "7" * 300 + ', "x": 1}', r"\$\.n: expected an integer in .* got -7{76}\.\.\.$"),
    ('{"n": 1.5, "x": 1}', r"\$\.n: expected an integer"),
    ('{"n": 1, "x": NaN}', r"not valid JSON \(NaN is not a JSON value\)"),
    ('{"n": 1, "x": Infinity}', r"not valid JSON \(Infinity is not a JSON value\)"),
    ('{"n": 1, "x": -Infinity}', r"not valid JSON \(-Infinity is not a JSON value\)"),
])
def test_what_no_column_holds_is_a_value_error(text, message):
    with pytest.raises(ValueError, match=message):
        parse_json_output(text, SCHEMA, TYPE)


def test_decoding_schema_bounds_every_int64_node_and_nothing_else():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**64},
            "c": {"type": "array", "items": {"$ref": "#/$defs/Count"}},
            "d": {"anyOf": [{"type": "integer", "maximum": 10}, {"type": "string"}]},
            "e": {"type": "number"},
            "f": {"type": ["integer", "number"]},
        },
        "$defs": {"Count": {"type": "integer", "minimum": -5}},
    }
    given = copy.deepcopy(schema)
    out = decoding_schema(schema)
    assert schema == given                                                  # the caller's schema is untouched
    props = out["properties"]
    assert props["a"] == {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND}
    assert (props["b"]["minimum"], props["b"]["maximum"]) == (0, INT_BOUND)
    assert out["$defs"]["Count"] == {"type": "integer", "minimum": -5, "maximum": INT_BOUND}
    assert props["c"]["items"] == {"$ref": "#/$defs/Count"}
    assert props["d"]["anyOf"] == [{"type": "integer", "minimum": -INT_BOUND, "maximum": 10}, {"type": "string"}]
    assert props["e"] == {"type": "number"} and props["f"] == {"type": ["integer", "number"]}
    assert INT_BOUND < 2**63 and float(INT_BOUND) == INT_BOUND


def test_a_pipeline_schema_bounded_at_int64s_own_limits_is_valid():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1}}}
    assert check_json_schema(schema) == schema
