"""`engine.storage.pinning`: the pinned allocator's settings, with torch's CUDA calls stubbed (runs without a GPU)."""
from __future__ import annotations

import pytest
import torch

from engine.storage import pinning
from engine.storage.pinned import HostPool


@pytest.fixture
def fake_cuda(monkeypatch):
    """A fresh process's pinning state on a machine that claims CUDA; the settings torch would get, recorded."""
    calls: list[str] = []
    monkeypatch.setattr(pinning, "_done", False)
    monkeypatch.setattr(pinning, "allocator_setter", lambda: calls.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinning, "_usable_cpus", lambda: 16)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return calls


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 2), (3, 2), (12, 8), (16, 16), (128, 16)])
def test_register_threads_is_a_power_of_two_within_the_cpus(cpus, threads):
    assert pinning.register_threads(cpus) == threads


def test_settings_register_pages_on_threads():
    assert pinning.settings({}, 6) == "pinned_use_cuda_host_register:True,pinned_num_register_threads:4"


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("conf", ["pinned_use_cuda_host_register:False",
                                  "expandable_segments:True,pinned_num_register_threads:2"])
def test_the_users_pinning_configuration_is_kept(var, conf):
    assert pinning.settings({var: conf}, 16) is None


def test_other_allocator_settings_do_not_stop_it():
    assert pinning.settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, 8) is not None


def test_configure_applies_once_per_process(fake_cuda):
    applied = pinning.configure()
    assert applied == "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"
    assert pinning.configure() is None
    assert fake_cuda == [applied]


def test_configure_keeps_the_users_choice(fake_cuda, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:False")
    assert pinning.configure() is None
    assert fake_cuda == []


def test_configure_does_nothing_without_cuda(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pinning.configure() is None
    assert fake_cuda == []


def test_a_torch_that_refuses_is_warned_about(fake_cuda, monkeypatch):
    def refuse(conf):
        raise RuntimeError("Unrecognized key 'pinned_use_cuda_host_register'")
    monkeypatch.setattr(pinning, "allocator_setter", lambda: refuse)
    with pytest.warns(UserWarning, match="single-threaded"):
        assert pinning.configure() is None


def test_a_pinning_pool_configures_first_and_a_plain_one_does_not(fake_cuda, monkeypatch):
    HostPool(pin=False)
    assert fake_cuda == []
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("no allocation at construction"))
    HostPool(pin=True)
    assert len(fake_cuda) == 1 and fake_cuda[0].startswith("pinned_use_cuda_host_register:True")
