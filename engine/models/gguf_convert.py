"""GGUF (llama.cpp) -> a Hugging Face style folder in the one model cache, converted once and reused.

`convert_gguf(path, cache_dir)` builds config.json from the GGUF metadata, the tokenizer files
(tokenizer.json, tokenizer_config.json with chat_template / eos / bos) with transformers' GGUF tokenizer
converter, and a tensor index (`gguf_tensors.json`, see engine.models.gguf_source): each tensor's Hugging
Face name, GGML type, shape, byte range in the GGUF and whether its rows carry llama.cpp's q/k permutation.
No weights are copied: the compact form stored is the GGUF's own quantized blocks, read from the GGUF file
and dequantized per layer at load (`GGUFSource`), so the cache folder is ~4 MB instead of a 517 MB fp32
copy. A tool that needs transformers' model of a GGUF loads it with transformers' own GGUF reader
(`from_pretrained(folder, gguf_file=name)`, as tests/test_smollm2.py does).

The folder is `cache_dir/<fingerprint>-v<FORMAT>/`, written atomically: into a temporary folder first, with
a `.complete.json` marker holding every file's size, then renamed into place. A folder whose marker is
missing or disagrees with the files on disk is rebuilt, never used. `cache_dir` is the model cache
(engine.models.loader.model_cache_dir: `$LLMOPS_MODEL_CACHE` or `~/.cache/llmops/models`), shared by
every result cache and process.

A GGUF file is checked before any tensor is read: every tensor's byte range must lie inside the file, so a
truncated download fails with `GGUFTruncatedError` naming the file, the first tensor past the end and the
sizes, not with a numpy reshape error.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from engine.models.gguf_source import INDEX

MARKER = ".complete.json"
FORMAT = 2     # 1: fp32 model.safetensors copy; 2: tensor index into the GGUF (no weight copy)
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SKIPPED = {"rope_freqs.weight"}  # llama.cpp's precomputed RoPE factors; config.json carries the scaling


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


def gguf_fingerprint(path: Path) -> str:
    """A stable id of a GGUF file's content: sha256 of its size, first and last MiB (reads 2 MiB)."""
    size = path.stat().st_size
    h = hashlib.sha256(f"gguf:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


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
    target = Path(cache_dir) / f"{gguf_fingerprint(path)}-v{FORMAT}"
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


def _config(reader: Any, gguf_path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {sorted(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def a(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = a("embedding_length"), a("attention.head_count")
    vocab = a("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    if a("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": [SUPPORTED_GGUF_ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": int(vocab), "hidden_size": int(hidden), "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")), "num_attention_heads": int(heads),
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": int(a("rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(a("context_length", 4096)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)), "rope_scaling": scaling,
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos, "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _hf_name(gguf_name: str, gguf_path: Path) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    raise ValueError(f"{gguf_path}: unexpected GGUF tensor {gguf_name!r}")


def tensor_index(reader: Any, config: dict[str, Any], gguf_path: Path) -> list[dict[str, Any]]:
    """One entry per needed tensor: HF name, GGUF name, GGML type, HF shape (outermost dim first: GGUF lists
    dims innermost first), absolute byte offset and length in the file, and the head count to unpermute
    q/k rows by (None for other tensors)."""
    out = []
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        name = _hf_name(t.name, gguf_path)
        heads = (config["num_attention_heads"] if name.endswith("q_proj.weight")
                 else config["num_key_value_heads"] if name.endswith("k_proj.weight") else None)
        out.append({"hf": name, "gguf": t.name, "type": int(t.tensor_type),
                    "shape": [int(d) for d in reversed(t.shape)], "offset": int(t.data_offset),
                    "n_bytes": int(t.n_bytes), "unpermute": heads})
    return out


def _write_tokenizer(gguf_path: Path, reader: Any, folder: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with chat_template) through transformers' GGUF converter."""
    try:
        from transformers import AutoTokenizer  # heavy; only GGUF tokenizer conversion (once per file)
    except ImportError:
        raise ImportError(
            f"converting the tokenizer of {gguf_path} needs `transformers` (pip install transformers)"
        ) from None
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
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
