"""Random-weight Llama- and Mixtral-shaped models with a real tokenizer, for benchmarks on machines without weights.

Two modes:

    # 1. where the embedded model is: copy SmolLM2's tokenizer (vocab 49152, ChatML chat template, eos
    #    <|im_end|>), which the engine converts out of the embedded GGUF, into a plain folder a GPU host can take
    python benchmarks/models/build_bench_model.py --export-tokenizer .bench_assets/smollm2_tokenizer
    #    (--gzip: tokenizer.json as tokenizer.json.gz, 3.5 -> 0.6 MB, for a size-limited copy)

    # 2. anywhere with torch, transformers, safetensors and tokenizers (no gguf needed): build a
    #    model with random weights and that tokenizer, saved as a Hugging Face folder
    python benchmarks/models/build_bench_model.py --out .bench_assets/tiny_model --tokenizer .bench_assets/smollm2_tokenizer \
        --shape tiny
    python benchmarks/models/build_bench_model.py --out /tmp/llama_1b --tokenizer .bench_assets/smollm2_tokenizer --shape 1b
    python benchmarks/models/build_bench_model.py --out /tmp/mixtral_8x7b_awq --tokenizer .bench_assets/smollm2_tokenizer \
        --shape mixtral-8x7b                         # 25 GB of AWQ int4, drawn on CUDA when there is one

Shapes (vocab always 49152, the tokenizer's, whatever the real model's): tiny (hidden 64, 2 layers: CPU tests),
1b (Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, tied embeddings), 3b
(Llama-3.2-3B: 3072, 28 layers, 24 heads, 8 kv, 8192, tied), 8b (Llama-3-8B: 4096, 32 layers, 32 heads, 8 kv,
14336, untied); mixtral-tiny (hidden 64, 2 layers, 4 heads, 2 kv, intermediate 128, 4 experts, top-2: CPU tests)
and mixtral-8x7b (Mixtral-8x7B: 4096, 32 layers, 32 heads, 8 kv, 14336, 8 experts, top-2, rope_theta 1e6,
32768 positions, untied; 46.8B parameters with this vocab instead of its own 32000). `--layers N` cuts any
shape to N layers (e.g. to time a build).

Llama shapes are bf16: a LlamaForCausalLM whose weights are drawn from N(0, std^2) (std 0.02, transformers' own
initializer) with `torch.manual_seed(seed)`, directly in bf16 on CUDA when there is one (an 8b model builds in
seconds there). Mixtral shapes are an AWQ int4 checkpoint (GEMM layout, groups of 128 inputs, of 32 for
mixtral-tiny), written tensor by tensor without ever building the float model (benchmarks/models/bench_int4.py):
attention projections and experts packed with random codes, zero points and scales whose dequantized weights
have std `std`; the router (`block_sparse_moe.gate`, in modules_to_not_convert as AutoAWQ's Mixtral
checkpoints have it), embeddings, norms and lm_head dense bf16; shards of about --shard-gb GB plus
model.safetensors.index.json; config.json a MixtralConfig with its quantization_config.
The folder is written under a temporary name and renamed into place; it holds config.json,
generation_config.json, model*.safetensors, the tokenizer files and bench_model.json (shape, seed, parameter
count, build time; "int4": "awq-g128" for an AWQ checkpoint) which benchmarks/operators/job_paths.py records. At the end
`engine.LLM(out)` loads it (headers only) and the chat template is checked; `--smoke` also generates 4 tokens
on the CPU (tiny shapes only).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import ROOT, write_json_atomic  # noqa: E402

# Files `engine.decoding.tokenizer.Tokenizer.from_dir` reads (tokenizer.json, tokenizer_config.json, chat_template.*) and
# what transformers writes beside them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json")
VOCAB = 49152

SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=10000.0),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=500000.0),
    "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               intermediate_size=8192, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0),
}
# Mixtral shapes: MixtralConfig fields, plus awq_group_size (the AWQ int4 checkpoint's group_size)
MIXTRAL_SHAPES: dict[str, dict] = {
    "mixtral-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                         max_position_embeddings=2048, rope_theta=1e6, awq_group_size=32),
    "mixtral-8x7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                         max_position_embeddings=32768, rope_theta=1e6, awq_group_size=128),
}
SMOKE_SHAPES = ("tiny", "mixtral-tiny")


def export_tokenizer(dest: Path, model: str, *, compress: bool = False) -> dict:
    """Copy the tokenizer folder the engine uses for `model` (for the alias: converted from its GGUF) to `dest`;
    `compress`: tokenizer.json as tokenizer.json.gz (3.5 MB -> 0.6 MB for a size-limited copy;
    --tokenizer accepts either form)."""
    from engine.models.loader import load_model

    src = load_model(model).tokenizer_dir
    if src is None:
        raise SystemExit(f"{model} has no tokenizer")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    copied = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    for name in copied:
        shutil.copy2(src / name, tmp / name)
    info = check_tokenizer(tmp)
    if compress:
        with open(tmp / "tokenizer.json", "rb") as f, gzip.open(tmp / "tokenizer.json.gz", "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
        (tmp / "tokenizer.json").unlink()
        copied = ["tokenizer.json.gz" if n == "tokenizer.json" else n for n in copied]
        check_tokenizer(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return {"from": str(src), "to": str(dest), "files": copied, **info}


def tokenizer_files(folder: Path, into: Path) -> list[str]:
    """Copy the tokenizer files of `folder` into `into`, decompressing tokenizer.json.gz; the names copied."""
    names = []
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, into / name)
            names.append(name)
    if "tokenizer.json" not in names and (folder / "tokenizer.json.gz").is_file():
        with gzip.open(folder / "tokenizer.json.gz", "rb") as g, open(into / "tokenizer.json", "wb") as f:
            shutil.copyfileobj(g, f)
        names.append("tokenizer.json")
    return names


def check_tokenizer(folder: Path) -> dict:
    """The facts the benchmark relies on (vocab, eos, chat template); SystemExit when one is missing."""
    from engine.decoding.tokenizer import Tokenizer

    if not (folder / "tokenizer.json").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer_files(folder, Path(tmp))
            return check_tokenizer(Path(tmp))
    tok = Tokenizer.from_dir(folder)
    if not tok.chat_template:
        raise SystemExit(f"{folder}: the tokenizer has no chat template")
    if not tok.eos_token_ids:
        raise SystemExit(f"{folder}: the tokenizer has no eos token")
    return {"vocab_size": tok.vocab_size, "eos_token": tok.eos_token, "eos_token_ids": list(tok.eos_token_ids),
            "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id}


def build_model(out: Path, tokenizer: Path, shape: str, *, seed: int, std: float, device: str, smoke: bool,
                layers: int | None = None, shard_bytes: int | None = None) -> dict:
    """Build the random `shape` (SHAPES or MIXTRAL_SHAPES; `layers` overrides num_hidden_layers) with the
    tokenizer folder `tokenizer` into `out` (module docstring); returns what bench_model.json holds plus the
    check's result. `shard_bytes`: the Mixtral shards' size (default bench_int4.SHARD_BYTES)."""
    import torch

    tok = check_tokenizer(tokenizer)
    if tok["vocab_size"] > VOCAB:
        raise SystemExit(f"{tokenizer}: vocab {tok['vocab_size']} > {VOCAB}")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    s = dict(SHAPES.get(shape) or MIXTRAL_SHAPES[shape])
    if layers is not None:
        s["num_hidden_layers"] = layers
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if shape in MIXTRAL_SHAPES:
        built = _write_mixtral_awq(tmp, s, tok, seed=seed, std=std, device=dev, shard_bytes=shard_bytes)
    else:
        built = _write_llama(tmp, s, tok, seed=seed, std=std, device=dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    tokenizer_files(tokenizer, tmp)
    info = {"shape": shape, **s, "vocab_size": VOCAB, "seed": seed, "std": std, **built, "built_on": str(dev),
            "tokenizer": str(tokenizer), "eos_token": tok["eos_token"]}
    write_json_atomic(tmp / "bench_model.json", info)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    info["check"] = check_model(out, smoke=smoke and shape in SMOKE_SHAPES)
    return info


def _hf_config(cls: type, s: dict, tok: dict, std: float, **extra: object) -> object:
    """A transformers config of class `cls` for shape fields `s` and the tokenizer facts `tok`."""
    eos = tok["eos_token_ids"][0]
    config = cls(vocab_size=VOCAB, head_dim=s["hidden_size"] // s["num_attention_heads"], rms_norm_eps=1e-5,
                 hidden_act="silu", initializer_range=std, bos_token_id=tok["bos_token_id"], eos_token_id=eos,
                 pad_token_id=eos, **s, **extra)
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return config


def _write_llama(tmp: Path, s: dict, tok: dict, *, seed: int, std: float, device: torch.device) -> dict:
    """A bf16 LlamaForCausalLM with N(0, std^2) weights saved into `tmp`; its bench_model.json fields."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = _hf_config(LlamaConfig, s, tok, std, attention_bias=False, mlp_bias=False)
    start = time.perf_counter()
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device), torch.no_grad():
            model = LlamaForCausalLM(config)
            # transformers' initializer already drew N(0, std) weights; redraw explicitly so the values do not
            # depend on the transformers version's init rules (norms stay at 1)
            gen = torch.Generator(device=device).manual_seed(seed)
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, std, generator=gen)
                else:
                    p.fill_(1.0)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    init_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    t_save = time.perf_counter()
    model.save_pretrained(str(tmp), safe_serialization=True)
    save_s = time.perf_counter() - t_save
    return {"dtype": "bfloat16", "params": params, "init_s": round(init_s, 2), "save_s": round(save_s, 2)}


def _write_mixtral_awq(tmp: Path, s: dict, tok: dict, *, seed: int, std: float, device: torch.device,
                       shard_bytes: int | None) -> dict:
    """An AWQ int4 MixtralForCausalLM checkpoint drawn tensor by tensor into `tmp` (bench_int4); its
    bench_model.json fields."""
    import torch
    from transformers import GenerationConfig, MixtralConfig

    from benchmarks.models.bench_int4 import SHARD_BYTES, logical_params, mixtral_tensors, write_checkpoint
    from engine.models.int4_config import Int4Config

    fields = {k: v for k, v in s.items() if k != "awq_group_size"}
    config = _hf_config(MixtralConfig, fields, tok, std, sliding_window=None)
    qc = {"quant_method": "awq", "bits": 4, "group_size": s["awq_group_size"], "zero_point": True,
          "version": "gemm", "modules_to_not_convert": ["gate"]}
    config.quantization_config = qc
    config.dtype = torch.bfloat16
    config.save_pretrained(str(tmp))
    GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
    tensors = mixtral_tensors(config.to_dict(), s["awq_group_size"])
    written = write_checkpoint(tmp, tensors, seed=seed, std=std, device=device,
                               shard_bytes=shard_bytes or SHARD_BYTES)
    return {"dtype": "bfloat16", "int4": Int4Config.from_hf(qc).tag, "params": logical_params(tensors),
            "init_s": written["draw_s"], "save_s": written["save_s"], "bytes": written["bytes"],
            "shards": written["shards"]}


def check_model(out: Path, *, smoke: bool) -> dict:
    """engine.LLM loads the folder (headers only) with its tokenizer and chat template; `smoke`: 4 tokens."""
    from engine import LLM, SamplingParams

    llm = LLM(str(out), device="cpu" if smoke else "auto")
    tok = llm.tokenizer
    if tok is None or not tok.chat_template:
        raise SystemExit(f"{out}: engine.LLM found no tokenizer / chat template")
    check = {"architecture": llm.config.architecture, "layers": llm.config.num_hidden_layers,
             "eos_token_ids": list(llm.eos_token_ids), "chat_template": True}
    if smoke:
        done = llm.generate([[{"role": "user", "content": "Say hi."}]], SamplingParams(max_new_tokens=4))
        check["smoke"] = {"tokens": len(done[0].token_ids), "finish_reason": done[0].finish_reason,
                          "prompt_tokens": done[0].prompt_tokens}
    llm.close()
    return check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--export-tokenizer", type=Path, metavar="DIR",
                    help="copy the tokenizer of --from (default: the embedded SmolLM2) into DIR and exit")
    ap.add_argument("--gzip", action="store_true", help="with --export-tokenizer: store tokenizer.json.gz")
    ap.add_argument("--from", dest="source", default="smollm2-135m-instruct", help="model whose tokenizer to export")
    ap.add_argument("--out", type=Path, help="folder to build the random model in (replaced)")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / ".bench_assets" / "smollm2_tokenizer")
    ap.add_argument("--shape", choices=[*SHAPES, *MIXTRAL_SHAPES], default="tiny")
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers instead of the shape's")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="Mixtral shapes: size of a safetensors shard (GB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="std of the random weights")
    ap.add_argument("--device", default="auto", help="where to initialise the weights (auto: cuda when present)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape: also generate 4 tokens on the CPU")
    args = ap.parse_args()
    if args.export_tokenizer is not None:
        print(json.dumps(export_tokenizer(args.export_tokenizer, args.source, compress=args.gzip), indent=2))
        return
    if args.out is None:
        ap.error("give --export-tokenizer DIR or --out DIR")
    print(json.dumps(build_model(args.out, args.tokenizer, args.shape, seed=args.seed, std=args.std,
                                 device=args.device, smoke=args.smoke, layers=args.layers,
                                 shard_bytes=int(args.shard_gb * 1e9)), indent=2))


if __name__ == "__main__":
    main()
