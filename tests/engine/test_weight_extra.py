"""`Policy.w_gpu_extra`: whole tensors on the gpu past the per-layer weight share, the rule (`with_extra`), the
search filling the device memory the share leaves, the explanation and the trial copies' share of them. The
executor's accounting and its tokens under such a policy are `test_policy_trial.py`'s and
`test_offload_matrix.py`'s (a policy with `w_gpu_extra` in each)."""
from dataclasses import replace

import pytest

from engine.calibrate.trial import copy_policy
from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy.cost_model import Workload, estimate
from engine.policy.estimate import Budgets
from engine.policy.hardware import reference_profile
from engine.policy.memory import weight_fraction_on
from engine.policy.placement import with_extra
from engine.policy.policy import Policy
from engine.policy.search import search
from engine.runtime.layout import model_layout

G, C, D = "gpu", "cpu", "disk"
GIB = 1 << 30
H200 = reference_profile("h200")


def test_each_extra_moves_the_first_off_gpu_tensor_of_the_next_layer_that_has_one():
    layers = [[G, G], [G, C, D], [G, G], [C, C], [D]]
    assert with_extra(layers, 0) == layers
    assert with_extra(layers, 2) == [[G, G], [G, G, D], [G, G], [G, C], [D]]
    assert with_extra(layers, 9) == [[G, G], [G, G, D], [G, G], [G, C], [G]]    # past the last one: all it can
    assert layers[1] == [G, C, D]                                               # the input is left as it was


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="w_gpu_extra"):
        Policy(w_gpu_extra=-1)


def test_search_fills_the_memory_the_share_leaves_with_whole_tensors():
    """Mixtral-8x7B over 2,048 rows at 16 GiB: the plan keeps a third of the experts on the gpu in every layer
    and fills the ~1 GiB left under the relaxed limit with more tensors: the plan's own memory fits, one more
    does not, and the prediction beats the same plan without them."""
    config = config_from_hf(PRESETS["mixtral-8x7b"])
    workload = Workload(prompt_len=77, gen_len=128, num_prompts=2048)
    budgets = Budgets(gpu_bytes=16 * GIB, cpu_bytes=110 * GIB, disk_bytes=0)
    layout = model_layout(config, 2, True)
    found = search(config, workload, budgets, H200, compress_weights=True, compress_cache=True, layout=layout)
    policy, limit = found.policy, 0.95 * budgets.gpu_bytes
    assert policy.w_gpu_extra > 0
    assert found.peak_memory_bytes["gpu"] <= limit
    without = estimate(config, replace(policy, w_gpu_extra=0), workload, H200, layout=layout)
    one_more = estimate(config, replace(policy, w_gpu_extra=policy.w_gpu_extra + 1), workload, H200, layout=layout)
    assert found.predicted_tokens_per_s > without.tokens_per_s * 1.02
    assert one_more.peak_memory_bytes["gpu"] > limit
    share = weight_fraction_on(layout, policy.w_gpu, policy.w_cpu, "cuda", policy.w_gpu_extra)[0]
    assert share > weight_fraction_on(layout, policy.w_gpu, policy.w_cpu, "cuda")[0]
    assert f"+ {policy.w_gpu_extra} whole tensors on the gpu" in found.explain()
    assert found.context["extra_weights_share"] == pytest.approx(
        share - weight_fraction_on(layout, policy.w_gpu, policy.w_cpu, "cuda")[0])


def test_a_trial_copy_holds_its_share_of_the_extra_tensors():
    policy = Policy(w_gpu=0.5, w_cpu=0.5, w_gpu_extra=9)
    assert copy_policy(policy, 2, 32).w_gpu_extra == 1
    assert copy_policy(policy, 6, 32).w_gpu_extra == 2
    assert copy_policy(Policy(), 2, 32) == Policy()
