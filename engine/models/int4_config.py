"""`Int4Config`: an AWQ / GPTQ int4 checkpoint's `quantization_config`, and which weights it holds packed.

Pure (no tensors, no files), so the config parser, the weight source, the executor's weight homes and the
policy's memory model all read one answer: a decoder matmul weight (`WeightSpec.quantizable`) is packed in
the checkpoint unless the module of one of its sources matches a `modules_to_not_convert` entry by
transformers' rule (`should_convert_module`: the entry as a regex from the start of the module name up to a
module boundary, or as a suffix: "gate" skips a router `...mlp.gate`, not `...mlp.gate_proj`); its groups are
`group_size` inputs, or the whole input row for -1.
`Int4SafetensorsSource` checks the file against this answer at load and names the tensor that disagrees.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.quant.config import QuantConfig

METHODS = ("awq", "gptq")
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}          # checkpoint_format -> the offset its zero points carry
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"               # a module-name boundary (transformers' should_convert_module)


def _skips(key: str, module: str) -> bool:
    """transformers' rule: `key` as a regex from the start of `module` up to a boundary, or as its suffix."""
    return bool(re.match(rf"(?:{key}){_BOUNDARY}", module)) or module.endswith(key)


@dataclass(frozen=True)
class Int4Config:
    """What loading an AWQ/GPTQ checkpoint needs from its quantization_config."""

    method: str                 # "awq" | "gptq"
    group_size: int             # -1 in the file (one group per input row) -> 0 here: the whole input dim
    zero_offset: int = 0        # GPTQ "gptq" format stores zero points minus one
    skip_modules: tuple[str, ...] = ()   # modules_to_not_convert: modules left in float

    @staticmethod
    def from_hf(q: dict[str, Any]) -> "Int4Config":
        """Validate config.json's quantization_config; ValueError naming the unsupported field and value."""
        method = str(q.get("quant_method", "")).lower()
        where = f"config.json quantization_config (quant_method={method!r})"
        if method not in METHODS:
            raise ValueError(f"{where}: only {list(METHODS)} int4 checkpoints are loaded")
        bits = q.get("bits", q.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{where}: bits={bits} is not supported (only 4)")
        group = int(q.get("group_size", q.get("q_group_size", 128)))
        if group != -1 and (group < 2 or group % 2):
            raise ValueError(f"{where}: group_size={group} is not supported (an even number >= 2, or -1)")
        skip = tuple(str(m) for m in (q.get("modules_to_not_convert") or ()))
        for key in skip:
            try:
                re.compile(key)
            except re.error as e:
                raise ValueError(f"{where}: modules_to_not_convert entry {key!r} is not a valid pattern: {e}") from None
        if method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"{where}: version={version!r} is not supported (only 'gemm'; its qweight layout)")
            if q.get("zero_point", True) is False:
                raise ValueError(f"{where}: zero_point=false is not supported (AWQ GEMM with zero points only)")
            return Int4Config(method, max(group, 0), skip_modules=skip)
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if fmt not in GPTQ_FORMATS:
            raise ValueError(f"{where}: checkpoint_format={fmt!r} is not supported; supported: {list(GPTQ_FORMATS)}")
        return Int4Config(method, max(group, 0), GPTQ_FORMATS[fmt], skip)

    def packs(self, sources: tuple[str, ...]) -> bool:
        """True when a quantizable weight fused from `sources` (tensor names `<module>.weight`) is packed in
        the checkpoint: no source's module matches a modules_to_not_convert entry (module docstring)."""
        return not any(_skips(key, s.removesuffix(".weight")) for s in sources for key in self.skip_modules)

    def quant_for(self, in_features: int) -> QuantConfig:
        """Our QuantConfig for a packed weight of `in_features` inputs: the checkpoint's own groups."""
        return QuantConfig(bits=4, group_size=self.group_size or in_features)

    @property
    def tag(self) -> str:
        """A short name for file/folder names: `awq-g128`, `gptq-grow` (one group per input row)."""
        return f"{self.method}-g{self.group_size or 'row'}"
