"""The embedding and the head held whole on CUDA: the rule, the memory model's accounting, the cost model; and
which expert layers are loaded a layer ahead (their slots)."""
import pytest

from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy.cost_model import Workload, estimate
from engine.policy.hardware import reference_profile
from engine.policy.memory import executor_memory, weight_fraction_on
from engine.policy.policy import Policy
from engine.policy.weight_slots import WeightSlots, held_whole, streamed_ahead
from engine.runtime.layout import model_layout

H200 = reference_profile("h200")
WORKLOAD = Workload(prompt_len=512, gen_len=32)


def test_one_layer_kinds_are_held_on_cuda_only():
    kinds = ["embed", "attention", "mlp", "attention", "mlp", "head"]
    assert held_whole(kinds, "cuda") == {"embed", "head"}
    assert held_whole(kinds, "cpu") == frozenset()
    assert held_whole(["embed"], "cuda") == frozenset()            # one layer: its buffer would alternate


@pytest.mark.parametrize("name, compress", [("llama-3-70b", True), ("opt-30b", False), ("mixtral-8x7b", True)])
def test_holding_costs_no_device_memory_and_frees_the_host_copy(name, compress):
    """All weights streamed: on CUDA the held kinds' homes take their buffers' place (the same gpu bytes),
    the host keeps no copy of them, and the realized gpu share of weights is theirs."""
    c = config_from_hf(PRESETS[name])
    layout = model_layout(c, 2, compress)
    policy = Policy(gpu_batch_size=16, w_gpu=0.0, w_cpu=1.0, compress_weights=compress, compress_cache=compress)
    held = executor_memory(c, layout, policy, 512, 32, 2, "cuda")
    # the same placement without the rule: every kind streamed through its buffers (the CPU device's view,
    # with cpu homes that need buffers, as on CUDA)
    edges = sum(kl.count * sum(kl.stored) for kl in layout.kinds if kl.kind in ("embed", "head"))
    assert layout.held("cuda") == {"embed", "head"}
    assert layout.held_fraction("cuda") == pytest.approx(edges / layout.total_bytes)
    assert weight_fraction_on(layout, 0.0, 1.0, "cuda")[0] == pytest.approx(edges / layout.total_bytes)
    assert weight_fraction_on(layout, 0.0, 1.0, "cpu")[0] == 0.0
    streamed_cpu = layout.total_bytes - edges
    assert held["cpu"] >= streamed_cpu
    assert held["cpu"] - streamed_cpu < edges                   # no host copy of the held kinds
    full = executor_memory(c, layout, Policy(gpu_batch_size=16, compress_weights=compress,
                                             compress_cache=compress), 512, 32, 2, "cuda")
    assert held["gpu"] < full["gpu"]


def test_held_kinds_are_not_moved_per_step():
    """The cost model charges no copy for the held kinds: streaming everything predicts a faster decode on
    CUDA than the same bytes spread over every layer would (the h2d channel bounds this decode)."""
    c = config_from_hf(PRESETS["llama-3-70b"])
    policy = Policy(gpu_batch_size=64, w_gpu=0.0, w_cpu=1.0, compress_weights=True, compress_cache=True)
    layout = model_layout(c, 2, True)
    est = estimate(c, policy, WORKLOAD, H200, layout=layout)
    assert est.decode_bottleneck == "cpu->gpu"
    moved = (1.0 - layout.held_fraction("cuda")) * layout.total_bytes
    step = est.decode_s / (WORKLOAD.gen_len - 1)
    assert step == pytest.approx(moved / (H200.h2d_gib_s * 2**30), rel=0.02)


def test_the_plan_says_what_is_held():
    """A plan for a GPU names the held kinds and their share, so "weights gpu 0.0%" is not read literally."""
    from engine.policy.estimate import Budgets
    from engine.policy.hardware import GIB
    from engine.policy.search import search

    c = config_from_hf(PRESETS["llama-3-70b"])
    est = search(c, Workload(200, 10, num_prompts=1536, shared_prefix_len=150), Budgets(16 * GIB, 100 * GIB),
                 H200, compress_weights=True, compress_cache=True, layout=model_layout(c))
    held = est.context["held_weights"]
    assert held["kinds"] == ["embed", "head"]
    assert held["share"] == pytest.approx(model_layout(c, 2, True).held_fraction("cuda"))
    assert "embed, head held on the gpu" in est.explain()


def test_only_compressed_experts_are_loaded_ahead():
    """`streamed_ahead`: a MoE model's experts when they are held 4-bit (a dense expert is read from its buffer
    by the GEMMs, so loading ahead would need a second buffer as large); never a dense model's MLPs."""
    for name, compress, want in (("mixtral-8x7b", True, {"mlp"}), ("mixtral-8x7b", False, set()),
                                 ("llama-3-70b", True, set())):
        layout = model_layout(config_from_hf(PRESETS[name]), 2, compress)
        assert layout.ahead == want, name
        assert streamed_ahead(layout.kind_order, layout.is_moe, compress) == want
        assert WeightSlots(layout.kind_order, layout.ahead).slots["mlp"] == (2 if want else 1)
