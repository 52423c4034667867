"""`engine.storage.device_cap`'s allocator settings, with torch's CUDA calls stubbed (runs without a GPU)."""
from __future__ import annotations

import types

import pytest
import torch

from engine.storage import device_cap


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's calls that `hold` makes, recorded; a fresh process's state in device_cap."""
    calls: list[tuple] = []
    monkeypatch.setattr(device_cap, "_segments_done", False)
    monkeypatch.setattr(device_cap, "_HELD", {})
    monkeypatch.setattr(device_cap, "allocator_setter", lambda: lambda conf: calls.append(("settings", conf)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=1 << 34))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: calls.append(("fraction", round(fraction, 4), index)))
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_first_hold_turns_expandable_segments_on_once(fake_cuda):
    cuda0 = torch.device("cuda", 0)
    a = device_cap.hold(cuda0, 1 << 32)
    b = device_cap.hold(cuda0, 1 << 33)
    assert fake_cuda.count(("settings", "expandable_segments:True")) == 1
    assert fake_cuda[:2] == [("settings", "expandable_segments:True"), ("empty_cache",)]
    assert ("fraction", 0.25, 0) in fake_cuda and fake_cuda[-1] == ("fraction", 0.5, 0)
    device_cap.release(b)
    assert fake_cuda[-1] == ("fraction", 0.25, 0)
    device_cap.release(a)
    assert fake_cuda[-1] == ("fraction", 1.0, 0)


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_allocator_choice_is_kept(fake_cuda, monkeypatch, var):
    monkeypatch.setenv(var, "max_split_size_mb:512,expandable_segments:False")
    device_cap.release(device_cap.hold(torch.device("cuda", 0), 1 << 32))
    assert not [c for c in fake_cuda if c[0] in ("settings", "empty_cache")]


def test_other_allocator_settings_still_get_expandable_segments():
    assert device_cap.wants_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    assert not device_cap.wants_expandable_segments({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})


def test_a_torch_that_cannot_set_them_warns_and_still_caps(fake_cuda, monkeypatch):
    def refuse(conf):
        raise RuntimeError("not supported")
    monkeypatch.setattr(device_cap, "allocator_setter", lambda: refuse)
    with pytest.warns(UserWarning, match="expandable segments.*not supported"):
        handle = device_cap.hold(torch.device("cuda", 0), 1 << 32)
    assert fake_cuda[-1] == ("fraction", 0.25, 0)
    device_cap.release(handle)


def test_the_accelerator_wide_setter_is_preferred(monkeypatch):
    def accelerator(conf):
        return conf

    def cuda_only(conf):
        return conf
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", cuda_only)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", accelerator, raising=False)
    assert device_cap.allocator_setter() is accelerator
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    assert device_cap.allocator_setter() is cuda_only


def test_the_cpu_has_no_cap(fake_cuda):
    assert device_cap.hold(torch.device("cpu"), 1 << 30) is None
    assert fake_cuda == []
