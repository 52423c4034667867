"""The CPU peer harness's pure parts: the llama.cpp build's CMake arguments from the CPU's flags, a finished
build found by its marker, and the per-batch ratios of our best over each peer's."""
from __future__ import annotations

import json

from benchmarks.throughput.cpu_peers import _ratios, same_rows
from benchmarks.throughput.llama_cpp_build import built_site, cmake_args


def test_cmake_args_follow_the_cpu_flags_and_leave_amx_out():
    args = cmake_args({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"})
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX512=ON" in args and "-DGGML_AVX512_VNNI=ON" in args
    assert "-DGGML_AVX512_BF16=OFF" in args and "-DGGML_AMX_INT8=OFF" in args and "-DGGML_AMX_TILE=OFF" in args
    assert "-DGGML_NATIVE=ON" in cmake_args({"neon", "asimd"})          # not x86: ggml's own native build


def test_a_build_counts_only_with_its_marker_and_arguments(tmp_path):
    (tmp_path / "site" / "llama_cpp").mkdir(parents=True)
    assert built_site(tmp_path) is None                                   # no marker: build again
    (tmp_path / "built.json").write_text(json.dumps({"version": "0", "cmake_args": "-DOTHER=ON"}))
    assert built_site(tmp_path) is None                                   # built with other arguments
    (tmp_path / "built.json").write_text(json.dumps({"version": "0", "cmake_args": cmake_args()}))
    assert built_site(tmp_path) == tmp_path / "site"


def test_ratios_name_each_sides_best_and_the_shipped_file():
    runs = {"ours": {"auto": {"tokens_per_s": 60.0, "prompt_tokens_per_s": 900.0}, "float32": {"tokens_per_s": 30.0}},
            "transformers": {"float32": {"tokens_per_s": 20.0}},
            "llama.cpp": {"Q4_1 (shipped)": {"tokens_per_s": 40.0, "prompt_tokens_per_s": 300.0},
                          "Q4_0": {"tokens_per_s": 50.0, "prompt_tokens_per_s": 450.0}, "BF16": {"skipped": "why"}}}
    out = _ratios(runs)
    assert out["best"]["ours"] == {"format": "auto", "tokens_per_s": 60.0}
    assert out["best"]["llama.cpp"]["format"] == "Q4_0"
    assert out["ours_over"] == {"transformers": 3.0, "llama.cpp": 1.2, "llama.cpp shipped file": 1.5,
                                "llama.cpp prompt processing": 2.0}
    assert same_rows([[1, 2], [3]], [[1, 2], [4]]) == 0.5 and same_rows([[1]], None) is None
