"""Shared fixtures (no helpers: those are in tests/helpers/): tiny random Hugging Face checkpoints built offline,
a tiny Llama with a tokenizer, and `fake`, the fake engine standing in for every engine the operator layer builds."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers.fake_engine import FakeLLM
from helpers.tiny_checkpoints import TINY_CONFIGS, build_tiny_checkpoint
from helpers.tiny_tokenizer import build_tiny_tokenizer
from llmops import engines


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny checkpoint folder per TINY_CONFIGS family, shared by every test of the run."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind in TINY_CONFIGS:
        build_tiny_checkpoint(kind, root / kind)
        out[kind] = root / kind
    return out


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoints, tmp_path_factory) -> Path:
    """A module's own copy of the tiny Llama folder with the tiny BPE tokenizer and chat template beside it."""
    folder = tmp_path_factory.mktemp("tiny_llama") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    build_tiny_tokenizer(folder)
    return folder


@pytest.fixture
def fake():
    """Every engine the operator layer builds is one FakeLLM (helpers/fake_engine.py, block size 2) for this
    test; the engine factory and cache are restored afterwards."""
    engine = FakeLLM(block_size=2)
    previous = engines.set_factory(lambda model, **settings: engine)
    yield engine
    engines.set_factory(previous)
