"""Weight homes: every layer's tensors placed on gpu/cpu/disk, and their loads into device buffers.

Each tensor's home is its buffer plan entry `home.{layer}.{tensor}` (`engine.policy.buffers.weight_homes`:
placement per layer by cumulative-size fractions, `w_gpu_extra` more tensors on the gpu, the kinds held whole on
the device on CUDA, `engine.policy.weight_slots.held_whole`), on its tier and in its stored form: 4-bit where
`engine.models.weights.stored_quant` says (an int4 checkpoint's packed weights in the checkpoint's own groups,
read packed from the source and kept bit for bit; other quantizable weights with `compress_weights`), dense
otherwise. gpu homes live on the compute device; cpu homes in
(pinned) host memory; disk homes in the engine's verified per-tensor files under
`<disk_dir>/weights/<fingerprint>-<dtype>-<compression>/`, built once and memory-mapped on later runs.
Device buffers `wbuf{slot}.{kind}.{name}` hold the loaded copy of a non-gpu layer, in the slot
`engine.policy.weight_slots.WeightSlots` gives it; a compressed tensor is dequantized on the compute stream
into one dense `wdq.{kind}.{name}` per kind. On CUDA a compressed buffer is free again once that dequantization
has run: `get` records an event after it, and the next load into the buffer waits for that event only, on the
`weight` stream, so it streams in while the previous layer's GEMMs still run (before, every load waited for
all compute issued before it, and with one buffer per kind the copy of MLP j + 2 waited for MLP j's GEMMs).
Dense tensors (norms, biases, the embedding table, uncompressed matrices) are read by the compute itself: their
loads wait for all compute issued before them, on their own `weight_dense` stream, so they never hold back a
compressed copy queued behind them. The kinds loaded a layer of their kind ahead (`ahead`: a MoE model's
compressed experts, `engine.policy.weight_slots.streamed_ahead`) keep one buffer for each compressed tensor
(slot 0, whatever the layer's slot): its load is issued after the previous layer's dequantization, so the
event is there to wait for; their dense tensors, read by a compute that may still be queued, alternate over
the kind's two slots.
A source that makes single weights (`DummySource.tensor`) makes each weight that is quantized on a GPU
there, so no dense host copy is filled and moved (dummy weights of 47B parameters are 93 GB of bf16).
Loads are paged: page p of P moves rows [r_p, r_p+1) of every non-gpu tensor (dim 0), so the transfer of
one layer can be spread over the K GPU batches of the previous layer (MoE-Lightning's paged weights).
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from engine.models.base import LayerSpec
from engine.models.cpu_linear import INT4_MAX_ROWS, dense_copy, int4_packable, pack_int4, pack_weight
from engine.policy.dtypes import dtype_name
from engine.quant.config import QuantConfig, int4_kernel_parts
from engine.quant.group import dequantize, quantize
from engine.quant.qtensor import QTensor, with_dtype
from engine.runtime.arena import Arena
from engine.runtime.transfers import Pending, Transfers
from engine.storage.copy import copy
from engine.storage.disk import WeightFiles
from engine.storage.tiers import Handle, Stored, Tier

_QUANT_CHUNK = 1 << 20          # elements quantized at once while placing weights (bounded host temporaries)


def _page_rows(rows: int, lo: float, hi: float, start: float, end: float) -> tuple[int, int]:
    """Rows of a tensor spanning bytes [lo, hi) of the layer that fall in the page [start, end)."""
    span = max(hi - lo, 1e-9)
    r0 = round(min(max((start - lo) / span, 0.0), 1.0) * rows)
    r1 = round(min(max((end - lo) / span, 0.0), 1.0) * rows)
    return r0, r1


def _quantize_rows(x: torch.Tensor, quant: QuantConfig, device: torch.device) -> QTensor:
    """quantize(x) computed on `device` a few rows at a time (bounded temporaries), the result left there:
    its home is filled from it directly (a copy into pinned memory on CUDA, not a pageable round trip)."""
    row = max(1, x[0].numel() if x.dim() > 1 else x.numel())
    step = max(1, _QUANT_CHUNK // row)
    parts = [quantize(x[r:r + step].to(device), quant) for r in range(0, x.shape[0], step)]
    cat = [torch.cat([getattr(p, name) for p in parts]) for name in ("data", "mn", "scale")]
    return QTensor(*cat, x.shape, quant, x.dtype)


def _on_host(v: Stored) -> Stored:
    """v in host memory (what a disk file is written from)."""
    if isinstance(v, QTensor):
        return QTensor(v.data.cpu(), v.mn.cpu(), v.scale.cpu(), v.shape, v.config, v.dtype)
    return v.cpu()


class WeightHomes:
    def __init__(self, loaded, specs: list[LayerSpec], *, dtype: torch.dtype, quant: QuantConfig | None,
                 arena: Arena, disk_dir: Path | None, ahead: frozenset[str] = frozenset(),
                 packed: frozenset[str] = frozenset(), int4_max_rows: int = INT4_MAX_ROWS, dense: bool = False):
        """`arena` holds the buffer plan whose `home.{layer}.{tensor}` entries say each tensor's tier and stored
        form; `quant`: the policy's weight compression (None: compress_weights off), which names the weight
        files. `ahead`: layer kinds whose compressed tensors have one buffer. `packed`: the weight names a
        CPU run holds in the form the CPU multiplies fastest (`_pack_for_cpu`); a 4-bit one runs the int4
        kernel for up to `int4_max_rows` rows, and with `dense` (`Policy.cpu_dense_copy`) multiplies a dense
        copy past them."""
        self.specs, self.dtype, self.quant, self.arena = specs, dtype, quant, arena
        self.ahead = ahead
        self.packed = packed if arena.device.type == "cpu" else frozenset()
        self.int4_max_rows = int4_max_rows
        self.dense = dense
        self.int4 = loaded.config.quantization_config
        self.device = arena.device
        self.homes: list[dict[str, Handle]] = []
        self.files: WeightFiles | None = None
        # per relay buffer: the H2D copy events of its previous use and of its current one (see `load`)
        self._relay_uses: dict[str, tuple[list, list]] = {}
        # per compressed device buffer ("{slot}.{kind}.{name}"): the event after its last dequantization, and
        # the address of the allocation that dequantization read
        self._released: dict[str, tuple[torch.cuda.Event, int]] = {}
        # wall seconds of placement: reading the source (a dummy source makes the tensors), quantizing (with
        # its copies to the device), and filling the homes (allocation, copies into them, each layer's sync)
        self.place_s = {"read": 0.0, "quantize": 0.0, "homes": 0.0}
        read_layer = getattr(loaded.weights, "get_stored", loaded.weights.get)   # packed where the source has it
        make_one = getattr(loaded.weights, "tensor", None)     # a source that makes one weight, on any device
        start = time.perf_counter()
        for spec in specs:
            names = list(spec.weights)
            planned = [arena.entry(f"home.{spec.name}.{n}") for n in names]
            tiers, quants = [Tier(e.tier) for e in planned], [e.quant for e in planned]
            source: dict[str, Stored] = {}
            read: list[bool] = []

            def read_one(name: str, q: QuantConfig | None) -> Stored:
                """The layer's tensor `name` from the source: one made on the device when the source makes
                single weights and this one is quantized there (on the host if the device is full), else
                from the layer's tensors, read once when first needed."""
                if make_one is not None:
                    if q is not None and self.device.type == "cuda":
                        try:
                            return make_one(spec, name, self.device)
                        except torch.cuda.OutOfMemoryError:
                            pass                   # the same values, made on the host
                    return make_one(spec, name)
                if not read:
                    source.update(read_layer(spec))
                    read.append(True)
                return source.pop(name)            # dropped once placed: the layer's copy shrinks as it goes

            def lap(part: str, t0: float) -> None:
                if self.device.type == "cuda":     # one stream: the sync only makes the time attributable
                    torch.cuda.current_stream().synchronize()
                self.place_s[part] += time.perf_counter() - t0

            def value(name: str, q: QuantConfig | None) -> Stored:
                t0 = time.perf_counter()
                x = read_one(name, q)
                lap("read", t0)
                if isinstance(x, QTensor):         # an int4 checkpoint's codes, kept as they are
                    if x.config != q:
                        raise ValueError(f"{spec.name}.{name}: the source holds groups of {x.config.group_size}, "
                                         f"the model's quantization_config says {q}")
                    return with_dtype(x, dtype)
                x = x.to(dtype)
                if q is None:
                    return x
                t0 = time.perf_counter()
                x = _quantize_rows(x, q, self.device)
                lap("quantize", t0)
                return x

            if Tier.DISK in tiers:
                files = self._weight_files(loaded, disk_dir)
                disk_names = [n for n, t in zip(names, tiers) if t is Tier.DISK]
                mapped = {}
                for n in disk_names:
                    q = quants[names.index(n)]
                    mapped.update(files.load(f"{spec.name}.{n}", lambda n=n, q=q: {n: _on_host(value(n, q))}))
            homes = {}
            for n, tier, q in zip(names, tiers, quants):
                if tier is Tier.DISK:
                    homes[n] = Handle(tier, arena.adopt(f"home.{spec.name}.{n}", mapped[n]))
                    continue
                v = value(n, q)
                dst = arena.get(f"home.{spec.name}.{n}", tier, tuple(v.shape), dtype, q)
                copy(dst, v)
                homes[n] = Handle(tier, dst)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            self._pack_for_cpu(spec, homes)
            self.homes.append(homes)
        self.place_s["homes"] = time.perf_counter() - start - self.place_s["read"] - self.place_s["quantize"]
        # per layer, the tensors a load moves (the rest compute reads in place)
        self._moving = [[(n, h) for n, h in homes.items() if not self._direct(h)] for homes in self.homes]

    def _pack_for_cpu(self, spec: LayerSpec, homes: dict[str, Handle]) -> None:
        """On a CPU run, hold each of the layer's `packed` weights in the compute's own form
        (`engine.models.cpu_linear`), made once here: a 4-bit matrix the int4 kernel takes as `Int4Linear`,
        its operands written to the planned buffers `packed.{layer}.{tensor}.codes|scales` beside its home and
        a prefill's dequantized copy to the kind's `wdq` (as an unpacked one's), or with `dense` its own dense
        copy dequantized once and reordered into oneDNN's layout, held as `packed.{layer}.{tensor}.dense`
        (`Arena.hold_elsewhere`); a dense bfloat16 one reordered
        into oneDNN's layout, which the arena then holds in place of its home (`Arena.hold_elsewhere`: the
        same bytes, so memory holds one copy of each weight)."""
        for n, handle in homes.items():
            if n not in self.packed or not self._direct(handle):
                continue
            value = handle.value
            if isinstance(value, QTensor):
                if not int4_packable(value):
                    continue
                parts = int4_kernel_parts(tuple(value.shape), dtype_name(value.dtype), value.config)
                into = tuple(self.arena.get(f"packed.{spec.name}.{n}.{part}", handle.tier, shape, getattr(torch, dtype))
                             for part, shape, dtype in parts)
                if self.dense:
                    key = f"packed.{spec.name}.{n}.dense"
                    out = self.arena.get(key, handle.tier, tuple(value.shape), self.dtype)
                    dense = self.arena.hold_elsewhere(key, dense_copy(value, out))
                    homes[n] = Handle(handle.tier, pack_int4(value, self.int4_max_rows, into, dense=dense))
                    continue
                scratch = self.arena.get(f"wdq.{spec.kind}.{n}", Tier.GPU, tuple(value.shape), self.dtype)
                homes[n] = Handle(handle.tier, pack_int4(value, self.int4_max_rows, into, scratch))
                continue
            packed = pack_weight(value)
            if packed is not value:
                homes[n] = Handle(handle.tier, self.arena.hold_elsewhere(f"home.{spec.name}.{n}", packed))

    @property
    def all_direct(self) -> bool:
        """True when compute reads every layer's weights in place (loads are no-ops)."""
        return not any(self._moving)

    def _weight_files(self, loaded, disk_dir: Path | None) -> WeightFiles:
        if self.files is None:
            if disk_dir is None:
                raise ValueError("the policy puts weights on disk (w_gpu + w_cpu < 1) but no disk_dir was given")
            fingerprint = getattr(loaded, "fingerprint", None) or "unfingerprinted"
            tag = hashlib.sha256(f"{fingerprint}".encode()).hexdigest()[:16]
            comp = "-".join(t.tag for t in (self.int4, self.quant) if t is not None) or "dense"
            dtype = str(self.dtype).removeprefix("torch.")
            self.files = WeightFiles(Path(disk_dir) / "weights" / f"{tag}-{dtype}-{comp}")
        return self.files

    def _direct(self, handle: Handle) -> bool:
        """True when compute can read the home without a copy (gpu tier, or cpu tier on a CPU-only machine)."""
        return handle.tier is Tier.GPU or (handle.tier is Tier.CPU and self.device.type == "cpu")

    def _key(self, j: int, slot: int, name: str, handle: Handle) -> str:
        """"{slot}.{kind}.{name}" of layer j's tensor `name` loaded into `slot`: slot 0 for a compressed tensor of
        a kind loaded ahead (module docstring)."""
        kind = self.specs[j].kind
        if kind in self.ahead and isinstance(handle.value, QTensor):
            slot = 0
        return f"{slot}.{kind}.{name}"

    def _buffer(self, j: int, slot: int, name: str, handle: Handle) -> Stored:
        quant = handle.value.config if isinstance(handle.value, QTensor) else None
        return self.arena.get(f"wbuf{self._key(j, slot, name, handle)}", Tier.GPU, tuple(handle.value.shape),
                              self.dtype, quant)

    def load(self, j: int, slot: int, page: int, pages: int, transfers: Transfers) -> list[Pending]:
        """Start moving page `page` of `pages` of layer j's non-resident tensors into buffer slot `slot`.

        A disk tensor on CUDA goes through the pinned relay `wrelay{slot}.{kind}.{name}`, written by an I/O
        thread: that thread first waits for the H2D copies of the relay's previous use (a layer's page 0 starts
        a new use; by then the previous use's threads have finished, as its compute waited for them), so the
        host never overwrites a relay the copy engine is still reading."""
        moving = self._moving[j]
        if not moving:
            return []
        if page == 0:
            for name, handle in moving:
                if handle.tier is Tier.DISK:
                    key = self._key(j, slot, name, handle)
                    self._relay_uses[key] = (self._relay_uses.get(key, ([], []))[1], [])
        total = sum(h.nbytes for _, h in moving)
        start, end = total * page / pages, total * (page + 1) / pages
        pendings, lo = [], 0
        for name, handle in moving:
            hi = lo + handle.nbytes
            rows = handle.value.shape[0]
            r0, r1 = _page_rows(rows, lo, hi, start, end)
            lo = hi
            if r1 <= r0:
                continue
            key, packed = self._key(j, slot, name, handle), isinstance(handle.value, QTensor)
            dst = self._buffer(j, slot, name, handle)
            relay, uses = None, ([], [])
            if handle.tier is Tier.DISK and self.device.type == "cuda":
                relay = self.arena.get(f"wrelay{key}", Tier.CPU, tuple(handle.value.shape), self.dtype,
                                       handle.value.config if packed else None)[r0:r1]
                uses = self._relay_uses[key]
            # a 4-bit buffer waits only for its last dequantization, if that read this very allocation (a
            # first or regrown buffer waits for all compute issued, as a dense one always does)
            released = self._released.get(key) if packed else None
            after = [released[0]] if released is not None and released[1] == dst.data.data_ptr() else None

            def fn(stream, dst=dst[r0:r1], src=handle.value[r0:r1], relay=relay, after=after, previous=uses[0],
                   current=uses[1]):
                for event in previous:
                    event.synchronize()
                event = copy(dst, src, stream=stream, relay=relay, after=after)
                if relay is not None:
                    current.append(event)
                return event
            pendings.append(transfers.submit("weight" if packed else "weight_dense", fn,
                                             threaded=handle.tier is Tier.DISK))
        return pendings

    def get(self, j: int, slot: int) -> dict[str, torch.Tensor]:
        """Layer j's dense weights on the compute device (after its loads into `slot` completed)."""
        out, released = {}, {}
        kind = self.specs[j].kind
        for name, handle in self.homes[j].items():
            direct = self._direct(handle)
            value = handle.value if direct else self._buffer(j, slot, name, handle)
            if isinstance(value, QTensor):
                if not direct:
                    released[self._key(j, slot, name, handle)] = value.data.data_ptr()
                dense = self.arena.get(f"wdq.{kind}.{name}", Tier.GPU, tuple(value.shape), self.dtype)
                value = dequantize(value, out=dense)
            out[name] = value
        if released and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._released.update({key: (event, ptr) for key, ptr in released.items()})
        return out
