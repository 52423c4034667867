"""GGUF (llama.cpp) -> a Hugging Face style folder in the one model cache, converted once and reused.

`convert_gguf(path, cache_dir)` builds config.json from the GGUF metadata (engine.models.gguf_arch: the
architectures `llama` (incl. Llama-3.1's `rope_freqs`), `qwen2`, `qwen3`, `qwen2moe`, `qwen3moe`, `gemma2`,
`gemma3`, `phi3`), the tokenizer files (tokenizer.json, tokenizer_config.json with chat_template / eos /
bos) with transformers' GGUF tokenizer builder (byte-level BPE from `tokenizer.ggml.tokens/merges/
token_type` with the split regex of `tokenizer.ggml.pre`; SentencePiece vocabularies, Gemma's and Phi3's
included, from tokens/scores), and a tensor index (`gguf_tensors.json`, see engine.models.gguf_source):
each HF tensor's GGUF name, GGML type, shape, byte range in the GGUF (a stacked expert tensor gives one
range per expert), whether its rows carry llama.cpp's q/k permutation and the offset its values carry.
No weights are copied: the compact form stored is the GGUF's own quantized blocks, read from the GGUF file
and dequantized per layer at load (`GGUFSource`; with `compress_weights` the executor requantizes each
layer into our 4-bit format as it places it), so the cache folder is ~4 MB (SmolLM2) instead of a 517 MB
fp32 copy, and a 4-bit copy of our own would only duplicate a file that is already compact and mapped.
A tool that needs transformers' model of a GGUF loads it with transformers' own GGUF reader
(`from_pretrained(folder, gguf_file=name)`, as tests/engine/test_smollm2.py does).

The folder is `cache_dir/<fingerprint>-v<FORMAT>/`, written atomically: into a temporary folder first, with
a `.complete.json` marker holding every file's size, then renamed into place. A folder whose marker is
missing or disagrees with the files on disk is rebuilt, never used. `cache_dir` is the model cache
(engine.models.cache.model_cache_dir: `$LLMOPS_MODEL_CACHE` or `~/.cache/llmops/models`), shared by
every result cache and process.

A GGUF file is checked before any tensor is read: every tensor's byte range must lie inside the file, so a
truncated download fails with `GGUFTruncatedError` naming the file, the first tensor past the end and the
sizes, not with a numpy reshape error.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from engine.models.gguf_arch import ARCHS, CONFIG_TENSORS, EXPERT_NAMES, GLOBAL_NAMES, hf_config
from engine.models.gguf_source import INDEX, dequantize_tensor
from engine.util.file_digest import file_digest

MARKER = ".complete.json"
# 1: fp32 model.safetensors copy; 2: tensor index into the GGUF (no weight copy), llama only;
# 3: + the architectures of engine.models.gguf_arch, per-expert slices, norm offsets, rope factors
FORMAT = 3
SUPPORTED_GGUF_ARCHITECTURES = {name: arch.hf_architecture for name, arch in ARCHS.items()}


class GGUFTruncatedError(ValueError):
    """A GGUF file ends before the data of one of its tensors (a partial download or copy)."""


def check_tensor_bounds(path: Path, file_size: int, data_start: int, infos: list[tuple[str, int, int]]) -> None:
    """Raise GGUFTruncatedError for the first tensor (name, offset from `data_start`, byte count) whose bytes
    run past `file_size`."""
    for name, offset, n_bytes in infos:
        end = data_start + offset + n_bytes
        if end > file_size:
            raise GGUFTruncatedError(
                f"{path}: truncated GGUF file: tensor {name!r} needs bytes {data_start + offset}..{end} but the "
                f"file has {file_size} bytes ({end - file_size} missing); download or copy it again")


def _reader(path: Path) -> Any:
    """A `gguf.GGUFReader` that checks every tensor's byte range against the file size before it maps the
    tensors (the reader itself would fail with "cannot reshape array of size ...")."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader  # only GGUF files need gguf

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:  # noqa: ANN001 (gguf's own hook)
            infos = []
            for field in fields:
                try:
                    _, name_data, _, dims, raw_dtype, offset = field.parts
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                    n_bytes = int(np.prod(dims)) * type_size // block
                    infos.append((bytes(name_data).decode("utf-8", "replace"), int(offset[0]), n_bytes))
                except (ValueError, KeyError, TypeError):  # a layout this check does not know: let gguf decide
                    continue
            check_tensor_bounds(path, len(self.data), int(start_offs), infos)
            super()._build_tensors(start_offs, fields)

    return CheckedReader(str(path))


def gguf_fingerprint(path: Path, cache_dir: Path | None = None) -> str:
    """A stable id of a GGUF file's content: the digest of every byte (metadata and every tensor,
    `engine.util.file_digest`), remembered in `cache_dir` (the model cache) while the file is unchanged."""
    return file_digest(path, cache_dir)


def cache_is_complete(folder: Path) -> bool:
    """True when `folder` holds a finished conversion: the marker exists and every size it lists matches."""
    marker = folder / MARKER
    try:
        sizes = json.loads(marker.read_text())["sizes"]
    except (OSError, ValueError, KeyError):
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == n for name, n in sizes.items())


def convert_gguf(path: Path, cache_dir: Path) -> Path:
    """The converted folder for the GGUF file `path`, converting it first if no complete one is cached."""
    target = Path(cache_dir) / f"{gguf_fingerprint(path, Path(cache_dir))}-v{FORMAT}"
    if cache_is_complete(target):
        return target
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
    tmp.chmod(0o755)
    try:
        _write_conversion(path, tmp)
        if target.exists():
            if cache_is_complete(target):  # another process finished first
                shutil.rmtree(tmp)
                return target
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not cache_is_complete(target):  # lost a race to another converter: use its folder
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _shape(t: Any) -> list[int]:
    return [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first; HF outermost first


def _config(reader: Any, gguf_path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {sorted(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}

    def small(name: str) -> list[float] | None:
        t = tensors.get(name)
        if t is None:
            return None
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        return [float(x) for x in dequantize_tensor(raw, int(t.tensor_type), tuple(_shape(t))).reshape(-1)]

    shapes = {name: _shape(t) for name, t in tensors.items()}
    return hf_config(arch, lambda key: _field(reader, key), set(tensors), shapes, small)


def _hf_names(gguf_name: str, arch: str, n_experts: int, gguf_path: Path) -> list[str]:
    """The HF tensor names one GGUF tensor becomes (one per expert for a stacked expert tensor)."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in ARCHS[arch].layer_names:
        return [f"model.layers.{m.group(1)}.{ARCHS[arch].layer_names[m.group(2)]}"]
    if m and m.group(2) in EXPERT_NAMES:
        return [f"model.layers.{m.group(1)}.{EXPERT_NAMES[m.group(2)].format(j=j)}" for j in range(n_experts)]
    if gguf_name in GLOBAL_NAMES:
        return [GLOBAL_NAMES[gguf_name]]
    raise ValueError(f"{gguf_path}: unexpected GGUF tensor {gguf_name!r} for architecture {arch!r}")


def tensor_index(reader: Any, config: dict[str, Any], gguf_path: Path) -> list[dict[str, Any]]:
    """One entry per needed HF tensor: HF name, GGUF name, GGML type, HF shape (outermost dim first), absolute
    byte offset and length in the file, the head count to unpermute q/k rows by (None for other tensors)
    and `offset_by`, subtracted from the values at load (Gemma's `1 + w` norms; 0 otherwise). A stacked
    expert tensor [E, rows, cols] gives E entries, each over its own contiguous byte range."""
    arch = _field(reader, "general.architecture")
    spec = ARCHS[arch]
    n_experts = int(config.get("num_experts") or 0)
    out = []
    for t in reader.tensors:
        if t.name in CONFIG_TENSORS:
            continue
        names = _hf_names(t.name, arch, n_experts, gguf_path)
        shape, n_bytes = _shape(t), int(t.n_bytes)
        if len(names) > 1:                              # stacked experts: [E, rows, cols] -> E x [rows, cols]
            shape, n_bytes = shape[1:], n_bytes // len(names)
        if t.name.endswith("ffn_gate_inp_shexp.weight"):
            shape = [1, shape[-1]]                      # HF [1, h]; converters write [h] or [1, h]
        for j, name in enumerate(names):
            heads = None
            if spec.permute_qk and name.endswith("q_proj.weight"):
                heads = config["num_attention_heads"]
            elif spec.permute_qk and name.endswith("k_proj.weight"):
                heads = config["num_key_value_heads"]
            norm = spec.norm_offset if name.endswith("norm.weight") else 0.0
            out.append({"hf": name, "gguf": t.name, "type": int(t.tensor_type), "shape": shape,
                        "offset": int(t.data_offset) + j * n_bytes, "n_bytes": n_bytes, "unpermute": heads,
                        "offset_by": norm})
    return out


_NO_HF_GGUF_MODEL = ("deepseek2",)     # architectures transformers 5.24 has no GGUF model mapping for


def _write_tokenizer(gguf_path: Path, reader: Any, folder: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with chat_template) through transformers' GGUF converter."""
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # heavy; only GGUF tokenizer conversion
    except ImportError:
        raise ImportError(
            f"converting the tokenizer of {gguf_path} needs `transformers` (pip install transformers)"
        ) from None
    # AutoTokenizer reads the GGUF's model config too and refuses architectures transformers cannot load
    # from GGUF (deepseek2); the tokenizer itself comes from the tokenizer.ggml.* keys alone
    auto = _field(reader, "general.architecture") not in _NO_HF_GGUF_MODEL
    cls = AutoTokenizer if auto else PreTrainedTokenizerFast
    tok = cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(folder))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    template = _field(reader, "tokenizer.chat_template") or getattr(tok, "chat_template", None)
    if template:
        cfg["chat_template"] = template
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        cfg.setdefault("add_bos_token", bool(add_bos))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _open(gguf_path: Path) -> Any:
    try:
        return _reader(gguf_path)
    except GGUFTruncatedError:
        raise
    except Exception as e:
        raise ValueError(f"cannot read GGUF file {gguf_path}: {e}") from None


def _write_conversion(gguf_path: Path, folder: Path) -> None:
    reader = _open(gguf_path)
    config = _config(reader, gguf_path)
    index = {"format": FORMAT, "source": str(gguf_path), "tensors": tensor_index(reader, config, gguf_path)}
    (folder / INDEX).write_text(json.dumps(index, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(gguf_path, reader, folder)
    sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    (folder / MARKER).write_text(json.dumps({"source": str(gguf_path), "format": FORMAT, "sizes": sizes}))
