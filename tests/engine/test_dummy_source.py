"""`engine.models.dummy_source`: one weight made alone, on any device, is the layer's weight bit for bit."""
from __future__ import annotations

import pytest
import torch

from engine.models.loader import load_model
from helpers.skips import requires_cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_weight_is_the_layers_weight(dtype):
    loaded = load_model("tiny-mixtral", dtype=dtype)
    source = loaded.weights
    for spec in loaded.family.layer_specs()[:4]:
        whole = source.get(spec)
        for name in spec.weights:
            one = source.tensor(spec, name)
            assert one.dtype == dtype and one.shape == whole[name].shape
            assert torch.equal(one, whole[name]), (spec.name, name)


@requires_cuda
def test_a_weight_made_on_the_gpu_has_the_hosts_values():
    loaded = load_model("tiny-mixtral", dtype=torch.bfloat16)
    spec = loaded.family.layer_specs()[2]
    for name in spec.weights:
        assert torch.equal(loaded.weights.tensor(spec, name, "cuda").cpu(), loaded.weights.tensor(spec, name))
