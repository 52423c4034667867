"""Hidden states between layers: the act placement parks only the prefill's; a decode step's [b, 1, h] stays
on the device, in the runtime (`ActHomes.store`), the memory model and the cost model alike."""
from types import SimpleNamespace

import pytest
import torch

from engine.models.hf_config import config_from_hf
from engine.models.presets import PRESETS
from engine.policy.affine import placement_vector
from engine.policy.cost_model import Workload, cost_terms
from engine.policy.hardware import reference_profile
from engine.policy.memory import executor_memory, untracked_gpu_bytes
from engine.policy.policy import Policy
from engine.runtime.act_homes import ActHomes
from engine.runtime.layout import model_layout

H200 = reference_profile("h200")


class _Transfers:
    """Records what would be copied; runs nothing."""

    def __init__(self):
        self.submitted: list[str] = []

    def submit(self, channel, fn, **kwargs):
        self.submitted.append(channel)
        return None


def _homes(act_gpu: float, act_cpu: float) -> ActHomes:
    # an accelerator's arena (the cpu tier is then a separate home); homes are plain host tensors
    arena = SimpleNamespace(device=torch.device("meta"), get=lambda name, tier, shape, dtype: torch.empty(shape))
    return ActHomes(arena, act_gpu, act_cpu, num_batches=2)


def test_a_decode_steps_hidden_state_is_never_parked():
    homes, transfers = _homes(0.0, 1.0), _Transfers()
    decode = torch.randn(4, 1, 8)                                  # [b, 1, h]
    assert homes.active
    assert homes.store(0, decode, transfers) is decode
    assert transfers.submitted == []


def test_a_prefill_hidden_state_moves_by_the_act_fractions():
    homes, transfers = _homes(0.5, 0.5), _Transfers()
    parked = homes.store(0, torch.randn(4, 6, 8), transfers)      # [b, P, h]: half the features to the host
    assert parked is not None and not isinstance(parked, torch.Tensor)
    assert transfers.submitted == ["store"]


class _Running(_Transfers):
    """Runs each copy at once, on no stream."""

    def submit(self, channel, fn, **kwargs):
        super().submit(channel, fn)
        fn(None)
        return None


def test_a_hidden_parked_whole_comes_back_without_a_copy():
    """All of a prefill hidden parked off the device comes back as the one buffer its load filled: `ready`
    reassembles with torch.cat only a hidden split over tiers (a whole [b, P, h] copy at every batch switch
    was device memory the model did not count)."""
    arena = SimpleNamespace(device=torch.device("cpu"), get=lambda name, tier, shape, dtype: torch.empty(shape))
    homes, transfers = ActHomes(arena, 0.0, 0.0, num_batches=2), _Running()      # the disk tier: it moves
    x = torch.randn(4, 6, 8)                                                       # [b, P, h]
    loaded = homes.load(0, homes.store(0, x, transfers), transfers)
    back = homes.ready(0, loaded)
    assert back is loaded.parts[0][3] and torch.equal(back, x)
    assert transfers.submitted == ["store", "load"]


class _Waits:
    """A pending transfer that records the first time the compute waits for it (a `Pending` waits once)."""

    def __init__(self, log: list[int], n: int):
        self.log, self.n = log, n

    def wait(self):
        if self.n not in self.log:
            self.log.append(self.n)


class _Numbered(_Transfers):
    """Records each submitted copy; its pending logs the copy's number when waited for; runs nothing."""

    def __init__(self):
        super().__init__()
        self.waits: list[int] = []

    def submit(self, channel, fn, **kwargs):
        super().submit(channel, fn)
        return _Waits(self.waits, len(self.submitted) - 1)


def test_a_hidden_parked_on_the_host_comes_back_by_rows_and_the_compute_waits_only_for_its_rows():
    """With the prefill's row chunks, a hidden parked whole in host memory is loaded one copy per chunk, and
    `arriving`'s `upto(r)` waits only for the copies of rows [0, r): the compute of the first chunk does not
    wait for the whole hidden to cross the link."""
    homes, transfers = _homes(0.0, 1.0), _Numbered()
    parked = homes.store(0, torch.randn(6, 5, 8), transfers)                      # [b, P, h], copy 0
    loaded = homes.load(0, parked, transfers, rows=[(0, 2), (2, 4), (4, 6)])      # copies 1, 2, 3
    assert transfers.submitted == ["store", "load", "load", "load"]
    x, upto = homes.arriving(0, loaded)
    assert x.shape == (6, 5, 8)
    assert transfers.waits == [0]                                                  # the load waited for its store
    upto(2)
    assert transfers.waits == [0, 1]
    upto(3)
    assert transfers.waits == [0, 1, 2]
    upto(None)
    assert transfers.waits == [0, 1, 2, 3]


def test_a_hidden_split_over_tiers_or_in_one_chunk_comes_back_whole():
    for act, rows in (((0.5, 0.5), [(0, 2), (2, 4)]), ((0.0, 1.0), [(0, 4)])):
        homes, transfers = _homes(*act), _Numbered()
        loaded = homes.load(0, homes.store(0, torch.randn(4, 5, 8), transfers), transfers, rows=rows)
        assert transfers.submitted == ["store", "load"]
        assert not hasattr(loaded, "arrivals")


def _mixtral():
    return config_from_hf(PRESETS["mixtral-8x7b"])


@pytest.mark.parametrize("prompt_len", [77, 1])
def test_memory_counts_a_decode_hidden_on_the_device_and_homes_only_for_the_prefill(prompt_len):
    config = _mixtral()
    g, K, h, e = 1024, 2, config.hidden_size, 2
    layout = model_layout(config, e, True)
    parked = Policy(gpu_batch_size=g, num_gpu_batches=K, act_gpu=0.0, act_cpu=1.0)
    resident = Policy(gpu_batch_size=g, num_gpu_batches=K)
    decode = (K - 1) * g * h * e                                   # the other batch's decode hidden [g, 1, h]
    prefill = (K - 1) * g * prompt_len * h * e                     # ... and its prefill hidden [g, P, h]
    assert untracked_gpu_bytes(config, parked, prompt_len, e, "cuda") == decode
    assert untracked_gpu_bytes(config, resident, prompt_len, e, "cuda") == prefill
    homes = (executor_memory(config, layout, parked, prompt_len, 128, e, "cuda")["cpu"]
             - executor_memory(config, layout, resident, prompt_len, 128, e, "cuda")["cpu"])
    assert homes == (K * g * prompt_len * h * e if prompt_len > 1 else 0)     # act.{k}.{n}: prefill only


@pytest.mark.parametrize("prompt_len", [77, 1])
def test_memory_counts_the_hidden_loaded_ahead_past_two_batches(prompt_len):
    """With K > 2 the schedule loads the next GPU batch's parked prefill hidden a slot ahead (`load_hidden`),
    so the device holds it during a compute: counted by the share off the gpu, at the prefill only (a decode
    step's [g, 1, h] is never parked); with K = 2 the load waits for its own slot and nothing is added."""
    config = _mixtral()
    g, K, h, e = 256, 4, config.hidden_size, 2
    decode = (K - 1) * g * h * e
    ahead = g * prompt_len * h * e if prompt_len > 1 else 0
    parked = Policy(gpu_batch_size=g, num_gpu_batches=K, act_gpu=0.0, act_cpu=1.0)
    split = Policy(gpu_batch_size=g, num_gpu_batches=K, act_gpu=0.25, act_cpu=0.75)
    assert untracked_gpu_bytes(config, parked, prompt_len, e, "cuda") == max(ahead, decode)
    placed = (K - 1) * g * prompt_len * h * e - decode
    want = placed * 0.25 + decode + max(0, ahead - decode) * 0.75
    assert untracked_gpu_bytes(config, split, prompt_len, e, "cuda") == int(want)
    two = Policy(gpu_batch_size=g, num_gpu_batches=2, act_gpu=0.0, act_cpu=1.0)
    assert untracked_gpu_bytes(config, two, prompt_len, e, "cuda") == g * h * e     # K = 2: loaded in its slot


def test_decode_channels_do_not_depend_on_the_act_placement():
    config, workload = _mixtral(), Workload(77, 128, num_prompts=2048)
    base = dict(gpu_batch_size=1024, num_gpu_batches=2, w_gpu=0.5, w_cpu=0.5, cache_gpu=0.0, cache_cpu=1.0,
                compress_weights=True, compress_cache=True)
    times, layout = [], model_layout(config)
    for act in (dict(act_gpu=1.0, act_cpu=0.0), dict(act_gpu=0.0, act_cpu=1.0)):
        policy = Policy(**base, **act)
        terms, x = cost_terms(config, policy, workload, H200, 2, layout=layout), placement_vector(policy)
        times.append(({c: terms.decode[c] @ [*x, 1] for c in terms.decode}, terms.decode_slots.seconds(x),
                      terms.prefill["cpu->gpu"] @ [*x, 1]))
    (on_gpu, slot_gpu, pre_gpu), (parked, slot_parked, pre_parked) = times
    assert on_gpu == pytest.approx(parked) and slot_gpu == pytest.approx(slot_parked)
    assert pre_parked > pre_gpu                                    # the prefill's hidden crosses the link
