"""Pipeline stages (FlexGen section 4.4): a model's decoder layers cut into contiguous stages, one per device.

Each stage holds and offloads its own layers on its own device; the embedding goes with the first stage and
the LM head with the last. Stages are balanced by per-layer cost: the bytes a layer's weights take (stored
size, 4-bit when compressed), which is what an offloading step moves per layer and what dominates its time
when weights stream from the CPU. The split minimizes the largest stage's cost exactly (a small dynamic
program over cut points), so the slowest stage, which bounds a pipeline's throughput, is as light as
possible. Torch-free: costs come in as numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from engine.policy import model_stats as ms
from engine.policy.layout import ModelConfig
from engine.policy.policy import Policy

Parallel = Literal["auto", "data", "pipeline"]


@dataclass(frozen=True)
class Stage:
    """Stage `index` of a pipeline: decoder layers `layers` (a range of decoder indices), plus the embedding
    when it is the first stage and the head when it is the last; `cost` is its share of the split's cost."""

    index: int
    layers: range
    first: bool
    last: bool
    cost: float

    def holds(self, kind: str, index: int) -> bool:
        """Whether the layer spec of `kind` ("embed", "attention", "mlp", "head") and decoder `index` runs here."""
        if kind == "embed":
            return self.first
        if kind == "head":
            return self.last
        return index in self.layers


def balanced_split(costs: Sequence[float], num_stages: int, *, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> list[range]:
    """Cut `costs` (one per decoder layer) into `num_stages` non-empty contiguous ranges minimizing the
    largest stage total, where the first stage also carries `first_extra` and the last `last_extra`. Ties
    go to the split whose earlier stages are larger (deterministic)."""
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"balanced_split: num_stages must be >= 1, got {num_stages}")
    if num_stages > n:
        raise ValueError(f"balanced_split: {num_stages} stages for {n} layers (each stage needs a layer)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(s: int, a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (first_extra if s == 0 else 0.0) + (last_extra if s == num_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][b]: the smallest largest-stage cost of layers [0, b) cut into stages 0..s; cut[s][b] the start of s
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for b in range(1, n + 1):
        best[0][b] = cost(0, 0, b)
    for s in range(1, num_stages):
        for b in range(s + 1, n + 1):
            for a in range(b - 1, s - 1, -1):
                value = max(best[s - 1][a], cost(s, a, b))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    bounds, b = [], n
    for s in range(num_stages - 1, 0, -1):
        a = cut[s][b]
        bounds.append(range(a, b))
        b = a
    bounds.append(range(0, b))
    return bounds[::-1]


def layer_costs(config: ModelConfig, bytes_per_element: int, compress: bool) -> tuple[list[float], float, float]:
    """(per decoder layer, embedding, head) weight bytes as stored: what the split balances."""
    per_layer = ms.layer_weight_bytes(config, bytes_per_element, compress)
    embed = ms.embed_numel(config) * bytes_per_element
    head = ms.head_numel(config) * bytes_per_element
    return [per_layer] * config.num_hidden_layers, float(embed), float(head)


def partition_model(config: ModelConfig, num_stages: int, bytes_per_element: int, compress: bool) -> list[Stage]:
    """The stages of `config` over `num_stages` devices, balanced by `layer_costs`."""
    costs, embed, head = layer_costs(config, bytes_per_element, compress)
    ranges = balanced_split(costs, num_stages, first_extra=embed, last_extra=head)
    last = len(ranges) - 1
    return [Stage(s, r, s == 0, s == last,
                  sum(costs[r.start:r.stop]) + (embed if s == 0 else 0.0) + (head if s == last else 0.0))
            for s, r in enumerate(ranges)]


def choose_parallel(requested: Parallel, policy: Policy, num_devices: int) -> Literal["single", "data", "pipeline"]:
    """How a plan's blocks use `num_devices` devices: "single" for one; else `requested`, where "auto" is
    "data" when the policy keeps every weight on the gpu tier (the model fits one device's budget: one
    engine per device, nothing to share) and "pipeline" otherwise (each device streams only its stage)."""
    if requested not in ("auto", "data", "pipeline"):
        raise ValueError(f"LLM(parallel=...): expected 'auto', 'data' or 'pipeline', got {requested!r}")
    if num_devices == 1:
        return "single"
    if requested != "auto":
        return requested
    return "data" if policy.w_gpu >= 1.0 else "pipeline"


def device_split(config: ModelConfig, policy: Policy, num_devices: int, bytes_per_element: int,
                 predicted_tokens_per_s: float, requested: Parallel = "auto") -> dict[str, Any]:
    """What `LLM(devices=[...N])` does with one device's plan `policy` (JSON-ready): the parallelism, the
    stages (decoder layers, stored weight bytes), rows in flight, and the predicted tokens/s: N times the
    one-device prediction, the ideal both ways (data: N independent engines; pipeline: N micro-batches
    keep every stage busy, each stage streaming only its own layers over its own link), before the
    pipeline's bubbles (a first-layer load per step and micro-batch, fill and drain): unmeasured."""
    mode = choose_parallel(requested, policy, num_devices)
    out: dict[str, Any] = {"num_gpus": num_devices, "parallel": mode, "rows_in_flight": num_devices * policy.block_size,
                           "predicted_tokens_per_s": num_devices * predicted_tokens_per_s,
                           "one_gpu_predicted_tokens_per_s": predicted_tokens_per_s}
    if mode == "pipeline":
        stages = partition_model(config, num_devices, bytes_per_element, policy.compress_weights)
        out["micro_batches"] = num_devices
        out["stages"] = [{"stage": st.index, "layers": [st.layers.start, st.layers.stop - 1], "embed": st.first,
                          "head": st.last, "weight_bytes": st.cost} for st in stages]
    return out


def explain_split(split: dict[str, Any]) -> str:
    """`device_split`'s result as a few readable lines."""
    n, mode = split["num_gpus"], split["parallel"]
    gib = 1024 ** 3
    if mode == "single":
        return "  devices    one GPU"
    lines = []
    if mode == "data":
        lines.append(f"  devices    {n} GPUs, data-parallel: one engine per GPU with this policy, "
                     f"blocks dealt to the free GPU ({split['rows_in_flight']} rows in flight)")
    else:
        lines.append(f"  devices    {n} GPUs, pipeline-parallel: {split['micro_batches']} micro-batches of one "
                     f"block each ({split['rows_in_flight']} rows in flight), each GPU its own stage:")
        for st in split["stages"]:
            extra = " + embedding" if st["embed"] else ""
            extra += " + head" if st["head"] else ""
            lines.append(f"    stage {st['stage']}  layers {st['layers'][0]}-{st['layers'][1]}{extra}: "
                         f"{st['weight_bytes'] / gib:.2f} GiB of weights")
    lines.append(f"  predicted  {split['predicted_tokens_per_s']:.1f} tokens/s ideal ({n} x "
                 f"{split['one_gpu_predicted_tokens_per_s']:.1f}; bubbles not modelled, unmeasured)")
    return "\n".join(lines)
