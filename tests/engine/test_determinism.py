"""Same answers in every process: `dtype="auto"` resolved once per machine (cached on disk), an output
fingerprint holding everything that produced the output (tokenizer, chat template, numerics version), and
one model cache shared by every result cache."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, Policy
from engine import fingerprint
from engine.calibrate import cpu_dtype
from engine.models import loader
from helpers.paths import REPO
from helpers.skips import requires_smollm2
from helpers.tiny_tokenizer import build_tiny_tokenizer


# ---- dtype="auto" on a CPU: measured once per machine -------------------------------------------------
@pytest.fixture
def fake_measure(monkeypatch):
    """Replace the GEMM timing by a recorded answer; returns the list of measurements made."""
    calls: list[torch.dtype] = []

    def measure(answer=torch.bfloat16):
        calls.append(answer)
        return answer, {"bfloat16_s": 1.0, "float32_s": 2.0}

    monkeypatch.setattr(cpu_dtype, "measure_cpu_dtype", measure)
    monkeypatch.setattr(cpu_dtype, "measure_int4_rows", lambda: 64)
    monkeypatch.setattr(cpu_dtype, "measure_int4_dense_rows", lambda: 4)
    return calls


def test_cpu_dtype_is_measured_once_and_read_from_disk(tmp_path, fake_measure):
    assert cpu_dtype.machine_cpu_dtype(tmp_path) == torch.bfloat16 and len(fake_measure) == 1
    path = cpu_dtype.cache_path(tmp_path)
    data = json.loads(path.read_text())
    assert data["dtype"] == "bfloat16" and data["key"] == cpu_dtype.machine_key()
    assert set(data["key"]) == {"hostname", "cpu_model", "torch_version"}
    for _ in range(3):   # a cleared in-memory cache: the file answers, nothing is timed again
        assert cpu_dtype.machine_cpu_dtype(tmp_path) == torch.bfloat16
    assert len(fake_measure) == 1
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


@pytest.mark.parametrize("content", [
    lambda key: "{not json",
    lambda key: "",
    lambda key: json.dumps([1, 2]),
    lambda key: json.dumps({"version": 1, "key": {**key, "hostname": "elsewhere"}, "dtype": "bfloat16"}),
    lambda key: json.dumps({"version": 1, "key": key, "dtype": "int3"}),
    lambda key: json.dumps({"version": 99, "key": key, "dtype": "float32"}),
], ids=["garbage", "empty", "not-an-object", "other-machine", "unknown-dtype", "other-version"])
def test_corrupt_or_foreign_cpu_dtype_file_is_measured_again(tmp_path, fake_measure, content):
    path = cpu_dtype.cache_path(tmp_path)
    path.write_text(content(cpu_dtype.machine_key()))
    assert cpu_dtype.machine_cpu_dtype(tmp_path) == torch.bfloat16 and len(fake_measure) == 1
    assert cpu_dtype.read_choice(path).dtype == torch.bfloat16     # replaced by a valid file


def _python(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, check=True,
                         capture_output=True, text=True, timeout=300)
    return out.stdout.strip()


def test_a_second_process_reads_the_same_dtype(tmp_path, fake_measure):
    """The cached answer wins over a new measurement: a file saying bfloat16 (whatever this CPU would
    measure) is what a fresh process's dtype="auto" resolves to."""
    cpu_dtype.machine_cpu_dtype(tmp_path)            # writes "bfloat16" (the fake measurement)
    code = "from engine.calibrate.cpu_dtype import fastest_cpu_dtype; print(fastest_cpu_dtype())"
    assert _python(code, {"LLMOPS_CACHE_DIR": str(tmp_path)}) == "torch.bfloat16"
    path = cpu_dtype.cache_path(tmp_path)
    path.write_text(path.read_text().replace("bfloat16", "float32"))
    assert _python(code, {"LLMOPS_CACHE_DIR": str(tmp_path)}) == "torch.float32"


# ---- the output fingerprint ------------------------------------------------------------------------
@pytest.fixture
def folder(tiny_checkpoints, tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    build_tiny_tokenizer(path)
    return path


def _fp(folder: Path) -> str:
    return LLM(folder, dtype="float32", device="cpu", policy=Policy(gpu_batch_size=4)).fingerprint


def test_fingerprint_holds_the_chat_template_and_tokenizer(folder, monkeypatch):
    base = _fp(folder)
    assert _fp(folder) == base
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    jinja = _fp(folder)
    (folder / "chat_template.jinja").unlink()
    assert _fp(folder) == base and jinja != base
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "chat_template": cfg["chat_template"] + " "}))
    edited = _fp(folder)
    cfg_path.write_text(json.dumps(cfg))
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["normalizer"] = {"type": "Lowercase"}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    other_tokenizer = _fp(folder)
    assert len({base, jinja, edited, other_tokenizer}) == 4
    monkeypatch.setattr(fingerprint, "NUMERICS_VERSION", fingerprint.NUMERICS_VERSION + 1)
    assert _fp(folder) != other_tokenizer


def test_fingerprint_and_auto_dtype_agree_across_processes(folder, tmp_path):
    """Two fresh processes with dtype="auto": the same dtype and the same fingerprint (the result-cache key)."""
    code = ("from engine import LLM; m = LLM(%r, device='cpu'); print(m.dtype, m.fingerprint)" % str(folder))
    env = {"LLMOPS_CACHE_DIR": str(tmp_path / "cache")}
    first, second = _python(code, env), _python(code, env)
    assert first == second and first.split()[0] in ("torch.float32", "torch.bfloat16")


# ---- one model cache ---------------------------------------------------------------------------------
def test_model_cache_does_not_follow_the_result_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMOPS_MODEL_CACHE", raising=False)
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path / "results-a"))
    default = loader.model_cache_dir()
    monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path / "results-b"))
    assert loader.model_cache_dir() == default and default.parts[-3:] == (".cache", "llmops", "models")
    monkeypatch.setenv("LLMOPS_MODEL_CACHE", str(tmp_path / "models"))
    assert loader.model_cache_dir() == tmp_path / "models"


@requires_smollm2
def test_gguf_conversion_is_shared_and_holds_no_weight_copy(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMOPS_MODEL_CACHE", raising=False)
    folders = set()
    for name in ("a", "b"):
        monkeypatch.setenv("LLMOPS_CACHE_DIR", str(tmp_path / name))
        folders.add(loader.load_model("smollm2-135m-instruct", dtype=torch.float32).tokenizer_dir)
    (folder,) = folders
    assert folder.parent == loader.model_cache_dir()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    files = {p.name: p.stat().st_size for p in folder.iterdir()}
    assert "gguf_tensors.json" in files and not any(n.endswith(".safetensors") for n in files)
    assert sum(files.values()) < 20 * 2**20       # config + tokenizer + index; the fp32 copy was 517 MB
