"""The frozen Policy: derived disk shares, validation, dict round-trip."""
import pytest

from engine import Policy


def test_disk_shares_are_derived():
    p = Policy(w_gpu=0.25, w_cpu=0.5, cache_gpu=0.0, cache_cpu=1.0, act_gpu=1.0)
    assert p.w_disk == pytest.approx(0.25)
    assert p.cache_disk == pytest.approx(0.0)
    assert p.act_disk == pytest.approx(0.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(w_gpu=0.7, w_cpu=0.5), "w_disk would be negative"),
        (dict(cache_gpu=1.5, cache_cpu=0.0), "cache_gpu must be in [0, 1]"),
        (dict(act_cpu=-0.1, act_gpu=0.0), "act_cpu must be in [0, 1]"),
        (dict(gpu_batch_size=0), "gpu_batch_size"),
    ],
)
def test_invalid_policies_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Policy(**kwargs)


def test_round_trip_and_unknown_field():
    p = Policy(gpu_batch_size=8, num_gpu_batches=3, w_gpu=0.2, w_cpu=0.8, cpu_attention=True)
    assert Policy.from_dict(p.to_dict()) == p
    assert p.block_size == 24
    with pytest.raises(ValueError, match="unknown field"):
        Policy.from_dict({**p.to_dict(), "percent": 1})
