"""The model as pure data: its weight tensors per layer, and where and how the executor holds them.

A `ModelLayout` lists the executor's layer specs in order (embed, attention/mlp per decoder layer, head), each
with its tensors' names and shapes and the 4-bit grouping each is held in with and without `compress_weights`
(an int4 checkpoint's packed weights in its own groups either way). It is computed once per model from its
family's layer specs, outside this package (`engine.runtime.layout.model_layout`: the policy package never
builds a model), for one dtype and one setting of `compress_weights` (`view` gives another). Everything the
memory model and the buffer plan need to know about the model's weights is read off it:
  - `kinds`: the tensors grouped by layer kind and shape (`KindLayout`: the decoder layers of one group have
    the same tensors; a kind whose layers differ, DeepSeek's dense first MLPs, Qwen-MoE's `mlp_only_layers`,
    has one group per distinct set), with their stored and dense bytes and the weight buffer slots their loads
    use (`weight_slots.WeightSlots`);
  - `placements`: the tier of every tensor under a policy's weight fractions, as the executor places it
    (`placement.weight_tiers` per layer; on CUDA the kinds held whole, `weight_slots.held_whole`, on the gpu;
    then `Policy.w_gpu_extra` more tensors on the gpu, `placement.with_extra`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable, TypeVar

from engine.policy.dtypes import dtype_of_size, element_size, stored_nbytes
from engine.policy.placement import first_off_gpu, weight_tiers, with_extra
from engine.policy.weight_slots import WeightSlots, held_whole, kind_fractions, streamed_ahead
from engine.quant.config import QuantConfig

ModelConfig = Any    # `engine.models.config.ModelConfig`, read as data (the policy package builds no model)
T = TypeVar("T")
Placed = dict[int, list[tuple[tuple[str, ...], tuple[int, ...]]]]    # id(KindLayout) -> [(tiers, layer positions)]


@dataclass(frozen=True)
class ExpertBuffers:
    """The padded buffers of one group of routed experts in `engine.models.moe.moe_experts`, as data:
    `row_elements` per padded row (its `expert_slot_bytes` per byte of element) and `group_bytes`, the most a
    group's padded buffers hold (`EXPERT_GROUP_BYTES`). `engine.runtime.layout.expert_buffers` reads both off
    the model's code."""

    row_elements: int
    group_bytes: int


@dataclass(frozen=True)
class TensorLayout:
    """One weight tensor of a layer: its name, logical shape, the 4-bit grouping it is held in without
    (`quant`: an int4 checkpoint's packed weights) and with (`compressed`) `compress_weights` (None: dense), and
    whether the family reads it only as a matmul's weight (`linear`: its `LINEAR_WEIGHTS`, which a CPU run
    holds in the form the CPU multiplies fastest, `engine.models.cpu_linear`)."""

    name: str
    shape: tuple[int, ...]
    quant: QuantConfig | None = None
    compressed: QuantConfig | None = None
    linear: bool = False


@dataclass(frozen=True)
class LayerLayout:
    """One layer spec of the executor: its name (`engine.models.base.LayerSpec.name`), kind, decoder index
    (-1: embed, head) and tensors in order."""

    name: str
    kind: str
    index: int
    tensors: tuple[TensorLayout, ...]


@dataclass(frozen=True)
class KindLayout:
    """The tensors of one layer kind (embed, attention, mlp, head) and shape: `count` specs of that kind (at
    positions `js` of the executor's order, named `layer_names`) with these tensors in order (names, logical
    shapes, stored bytes, dense bytes, 4-bit grouping or None), and the weight slots their loads use over a
    run (`slot_set`). `ahead`: the kind is loaded a layer ahead (`weight_slots.streamed_ahead`): its 4-bit
    tensors have one buffer, slot 0."""

    kind: str
    count: int
    stored: tuple[int, ...]
    dense: tuple[int, ...]
    packed: tuple[bool, ...]
    names: tuple[str, ...] = ()
    slot_set: tuple[int, ...] = ()
    ahead: bool = False
    js: tuple[int, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    quants: tuple[QuantConfig | None, ...] = ()
    layer_names: tuple[str, ...] = ()
    linear: tuple[bool, ...] = ()


@dataclass(frozen=True)
class ModelLayout:
    """The executor's weights for one model, dtype and weight compression (module docstring). `is_moe`: a
    sparse-MoE model; `experts`: its expert group buffers (`ExpertBuffers`), for the working memory."""

    layers: tuple[LayerLayout, ...]
    dtype: str = "float16"
    compress_weights: bool = False
    is_moe: bool = False
    experts: ExpertBuffers | None = None

    @cached_property
    def _derived(self) -> dict[tuple, Any]:
        return {}

    def derived(self, key: tuple, make: Callable[[], T]) -> T:
        """`make()`, computed once per layout and `key` (what a search asks for again and again: the
        placements and weight buffers of a weight setting). The value is shared: never modify it."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def view(self, bytes_per_element: int, compress_weights: bool) -> ModelLayout:
        """This model's layout in `bytes_per_element`-byte elements (this dtype when its size matches) and with
        `compress_weights` (`self` when both match)."""
        dtype = self.dtype if element_size(self.dtype) == bytes_per_element else dtype_of_size(bytes_per_element)
        if dtype == self.dtype and compress_weights == self.compress_weights:
            return self
        return replace(self, dtype=dtype, compress_weights=compress_weights)

    def stored_quant(self, tensor: TensorLayout) -> QuantConfig | None:
        """The grouping `tensor` is held in under this layout's `compress_weights` (None: dense)."""
        return tensor.compressed if self.compress_weights else tensor.quant

    @property
    def element_size(self) -> int:
        return element_size(self.dtype)

    @property
    def num_specs(self) -> int:
        return len(self.layers)

    @cached_property
    def kind_order(self) -> tuple[str, ...]:
        """The kind of each layer spec, in order."""
        return tuple(layer.kind for layer in self.layers)

    @cached_property
    def attention_js(self) -> tuple[int, ...]:
        """The positions of the attention layer specs."""
        return tuple(j for j, kind in enumerate(self.kind_order) if kind == "attention")

    @cached_property
    def ahead(self) -> frozenset[str]:
        """The kinds loaded a layer of their kind ahead (`weight_slots.streamed_ahead`)."""
        packed = all(self.stored_quant(t) is not None for layer in self.layers if layer.kind == "mlp"
                     for t in layer.tensors if t.compressed is not None)
        return streamed_ahead(self.kind_order, self.is_moe, packed)

    @cached_property
    def slots(self) -> WeightSlots:
        """The weight buffer slot rule of these layers (`weight_slots.WeightSlots`)."""
        return WeightSlots(self.kind_order, self.ahead)

    @cached_property
    def once(self) -> frozenset[str]:
        """The kinds of one layer: held whole on CUDA (`weight_slots.held_whole`)."""
        return held_whole(self.kind_order, "cuda")

    @cached_property
    def kinds(self) -> tuple[KindLayout, ...]:
        """The layer specs grouped by kind and tensors (module docstring)."""
        dtype, slots = self.dtype, self.slots
        groups: dict[tuple, list[int]] = {}
        for j, layer in enumerate(self.layers):
            key = (layer.kind, tuple((t.name, t.shape, t.quant, t.compressed, t.linear) for t in layer.tensors))
            groups.setdefault(key, []).append(j)
        kinds = []
        for js in groups.values():
            first = self.layers[js[0]]
            quants = tuple(self.stored_quant(t) for t in first.tensors)
            dense = tuple(stored_nbytes(t.shape, dtype) for t in first.tensors)
            stored = tuple(stored_nbytes(t.shape, dtype, q) for t, q in zip(first.tensors, quants))
            kinds.append(KindLayout(
                first.kind, len(js), stored, dense, tuple(q is not None for q in quants),
                tuple(t.name for t in first.tensors), slots.slot_set(js), first.kind in self.ahead, tuple(js),
                tuple(t.shape for t in first.tensors), quants, tuple(self.layers[j].name for j in js),
                tuple(t.linear for t in first.tensors)))
        return tuple(kinds)

    @cached_property
    def total_bytes(self) -> int:
        return sum(k.count * sum(k.stored) for k in self.kinds)

    @cached_property
    def midpoints(self) -> tuple[float, ...]:
        """Sorted fractions at which some tensor changes tier."""
        mids = set()
        for kl in self.kinds:
            total, start = sum(kl.stored) or 1, 0
            for size in kl.stored:
                mids.add((start + size / 2) / total)
                start += size
        return tuple(sorted(mids))

    def held(self, device_type: str) -> frozenset[str]:
        """The kinds the executor holds whole on a `device_type` device, whatever the weight fractions."""
        return self.once if device_type == "cuda" else frozenset()

    def tiers(self, kl: KindLayout, w_gpu: float, w_cpu: float, device_type: str) -> list[str]:
        """The tier of each of group kl's tensors under these policy fractions, as the executor places them."""
        return weight_tiers(list(kl.stored), *kind_fractions(kl.kind, self.held(device_type), w_gpu, w_cpu))

    def placements(self, w_gpu: float, w_cpu: float, device_type: str, extra: int = 0) -> Placed:
        """Per group (keyed by `id` of its KindLayout), (the tiers of its tensors, the positions of the layers
        that have them) as the executor places them: the fractions' tiers, then `extra` more tensors on the gpu
        (`with_extra`, in layer order)."""
        return self.derived(("placements", w_gpu, w_cpu, device_type, extra),
                            lambda: self._placements(w_gpu, w_cpu, device_type, extra))

    def _placements(self, w_gpu: float, w_cpu: float, device_type: str, extra: int) -> Placed:
        base = {id(kl): tuple(self.tiers(kl, w_gpu, w_cpu, device_type)) for kl in self.kinds}
        if not extra:                                  # every layer of a group alike
            return {id(kl): [(base[id(kl)], kl.js)] for kl in self.kinds}
        at = {j: kl for kl in self.kinds for j in kl.js}
        order = sorted(at)
        js: dict[int, dict[tuple[str, ...], list[int]]] = {id(kl): {} for kl in self.kinds}
        for j, layer in zip(order, with_extra([base[id(at[j])] for j in order], extra)):
            js[id(at[j])].setdefault(tuple(layer), []).append(j)
        return {key: [(tiers, tuple(members)) for tiers, members in by.items()] for key, by in js.items()}

    def placed(self, w_gpu: float, w_cpu: float, device_type: str,
               extra: int = 0) -> dict[int, list[tuple[tuple[str, ...], int]]]:
        """`placements` with a count of layers in place of their positions."""
        return {key: [(tiers, len(js)) for tiers, js in group]
                for key, group in self.placements(w_gpu, w_cpu, device_type, extra).items()}

    def bytes_on(self, placed: dict[int, list[tuple[tuple[str, ...], int]]]) -> dict[str, int]:
        """Weight bytes per tier of a placement `placed` returned."""
        on = {"gpu": 0, "cpu": 0, "disk": 0}
        for kl in self.kinds:
            for tiers, count in placed[id(kl)]:
                for size, tier in zip(kl.stored, tiers):
                    on[tier] += count * size
        return on

    def extra_sizes(self, w_gpu: float, w_cpu: float, device_type: str) -> list[int]:
        """Stored bytes of the tensor each further `Policy.w_gpu_extra` puts on the gpu, in turn (`with_extra`'s
        order: the first tensor off the gpu of each layer that has one, in layer order)."""
        sizes = {}
        for kl in self.kinds:
            off = first_off_gpu(self.tiers(kl, w_gpu, w_cpu, device_type))
            if off is not None:
                sizes.update({j: kl.stored[off] for j in kl.js})
        return [sizes[j] for j in sorted(sizes)]

    def held_fraction(self, device_type: str) -> float:
        """The fraction of all weight bytes the held kinds take: on the gpu under every policy."""
        held = self.held(device_type)
        return sum(kl.count * sum(kl.stored) for kl in self.kinds if kl.kind in held) / (self.total_bytes or 1)
