"""CPU peers: our engine, transformers' `generate` and llama.cpp on the same GGUF, the same prompts, greedy, at
batch 1, 8 and 64.

Every side gets the same prompt token ids (chat-templated row texts of `cpu_generate.build_prompts`, encoded
once by our tokenizer), generates greedily, stops a row at an end-of-generation id or after
--max-new-tokens, and counts the tokens it generated up to and including that id. Batch b runs the prompts b
at a time (batch 1: the first --batch1-prompts prompts one by one); each (batch, side, format) runs once,
the sides interleaved within a batch size, so a machine whose load drifts shifts them alike (on a shared
machine the ratios hold better than the absolute rates). Formats per side:
  - ours: each of --ours (`dtype` of `LLM`, e.g. float32, bfloat16, auto: the machine's choice; "+w4" after
    it: compress_weights, the decoder's matrices held 4-bit in the GGUF's groups of 32; "+w4dense": those
    and, with `Policy.cpu_dense_copy`, a dense copy of each that multiplies past the int4 kernel's crossing);
  - transformers: each of --hf (it reads the GGUF itself, dequantized into that dtype);
  - llama.cpp: the shipped file, and each of --llama re-quantized from it by llama.cpp (Q4_0, Q8_0, BF16),
    through `llama-cpp-python` built from source for this CPU (`llama_cpp_build`; skipped, with the reason,
    when it cannot build in --build-limit seconds); its C API runs the rows of a batch as llama.cpp sequences
    (`llama_cpp_worker.py`, a separate process).
Each peer runs in a process of its own, as its users run it: an `LLM` on a CPU sets the allocator of the process
it runs in (`engine.util.host_heap`), which a peer's users do not have.
Per run: generated tokens, seconds (prefill + decode, load and warm-up excluded), tokens/s, the prefill's
prompt tokens/s (ours and llama.cpp), and the share of rows whose tokens equal ours in float32. The record
(one per model) holds every run and, per batch, each side's best and the ratios of our best to theirs
and to llama.cpp on the shipped file; tokens_per_s is our best at the largest batch. Appended to
benchmarks/records/<machine>/cpu_peers.jsonl (or --out). The optional second model (--models) runs when
its packages are installed, else it is recorded as skipped.

    python benchmarks/throughput/cpu_peers.py
    python benchmarks/throughput/cpu_peers.py --batches 1 --ours float32 --hf float32 --llama Q4_0 --prompts 8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import Timer, add_record_args, new_record, save_record  # noqa: E402
from benchmarks.throughput.cpu_generate import build_prompts, run_hf  # noqa: E402
from benchmarks.throughput.llama_cpp_build import BUILD_LIMIT_S, ensure_llama_cpp  # noqa: E402
from engine import LLM, Policy, SamplingParams  # noqa: E402
from engine.decoding.prompts import encode_prompts  # noqa: E402
from engine.models.aliases import ALIASES, alias_available, resolve_alias  # noqa: E402

BENCHMARK, WORKLOAD = "cpu_peers", "sample-prompts"
WORKER = Path(__file__).with_name("llama_cpp_worker.py")
REFERENCE = ("ours", "float32")            # the tokens every run is compared with


def encoded_prompts(llm: LLM, n: int, max_new: int) -> list[list[int]]:
    """n chat-templated prompts over table rows as `llm`'s token ids."""
    texts, _ = build_prompts(n)
    params = SamplingParams(max_new_tokens=max_new)
    return [e.ids for e in encode_prompts(texts, params, llm.tokenizer, llm.config.vocab_size, llm.max_context)]


OURS_SUFFIXES = {"": {}, "w4": {"compress_weights": True},
                 "w4dense": {"compress_weights": True, "cpu_dense_copy": True}}     # "+suffix" -> Policy flags


def run_ours(model: str, form: str, prompts: list[list[int]], batch: int, max_new: int) -> dict[str, Any]:
    """`form`: an `LLM` dtype, "+w4" after it for compress_weights (the GGUF's 4-bit weights kept 4-bit),
    "+w4dense" for those with a dense copy too (`Policy.cpu_dense_copy`)."""
    dtype, _, suffix = form.partition("+")
    if suffix not in OURS_SUFFIXES:
        raise ValueError(f"--ours {form!r}: the suffix after '+' is one of {sorted(OURS_SUFFIXES)[1:]}")
    flags = OURS_SUFFIXES[suffix]
    policy = Policy(gpu_batch_size=batch, **flags)                                     # a given policy says it
    with LLM(model, dtype=dtype, device="cpu", policy=policy,
             compress_weights=flags.get("compress_weights", False)) as llm:
        llm.generate(prompts[:batch][:8], SamplingParams(max_new_tokens=4))        # warm-up: places the weights
        before = llm.stats.prefill_s
        with Timer() as t:
            out = llm.generate(prompts, SamplingParams(max_new_tokens=max_new))
        prefill_s = llm.stats.prefill_s - before
        resolved = str(llm.dtype).removeprefix("torch.")
    tokens = [c.token_ids for c in out]
    return {"dtype": resolved, **_rates(tokens, t.seconds, prefill_s, prompts)}


def run_transformers(model: str, dtype: str, prompts: list[list[int]], batch: int, max_new: int,
                     eos: set[int], pad: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    gguf = resolve_alias(model)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)).eval()
    tok = _PadOnly(pad)
    run_hf(hf, tok, prompts[:1], 1, 2, eos)                                          # warm-up
    tokens: list[list[int]] = [[] for _ in prompts]
    with Timer() as t:
        for s in range(0, len(prompts), batch):
            part = prompts[s:s + batch]
            width = max(map(len, part))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in part])                       # [b, s]
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part])            # [b, s]
            with torch.inference_mode():
                new = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                  pad_token_id=pad)[:, width:].tolist()
            for r, row in enumerate(new):
                stop = next((k for k, x in enumerate(row) if x in eos), None)
                tokens[s + r] = row if stop is None else row[:stop + 1]
    return _rates(tokens, t.seconds, None, prompts)


def transformers_process(model: str, dtype: str, prompts: list[list[int]], batch: int, max_new: int,
                         eos: set[int], pad: int, threads: int) -> dict[str, Any]:
    """`run_transformers` in a fresh process (this script's --transformers-worker): transformers as its users run
    it, without the allocator settings an `LLM` on a CPU gives the process it runs in (`engine.util.host_heap`,
    process-wide)."""
    request = {"model": model, "dtype": dtype, "prompts": prompts, "batch": batch, "max_new": max_new,
               "eos": sorted(eos), "pad": pad, "threads": threads}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--transformers-worker"],
                          input=json.dumps(request), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"transformers worker failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def transformers_worker() -> None:
    """One `transformers_process` request from stdin; its result as the last line of stdout."""
    r = json.loads(sys.stdin.read())
    torch.set_num_threads(r["threads"])
    out = run_transformers(r["model"], r["dtype"], r["prompts"], r["batch"], r["max_new"], set(r["eos"]), r["pad"])
    sys.stdout.write(json.dumps(out) + "\n")


class _PadOnly:
    """What `cpu_generate.run_hf` reads of a tokenizer: the pad id."""

    def __init__(self, pad: int) -> None:
        self.pad_token_id = pad


def llama_cpp(site: Path, request: dict[str, Any]) -> dict[str, Any]:
    """One request to `llama_cpp_worker.py` in a fresh process with `site` on its path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = subprocess.run([sys.executable, str(WORKER)], input=json.dumps(request), capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_llama(site: Path, gguf: Path, prompts: list[list[int]], batch: int, max_new: int, eos: set[int],
              threads: int) -> dict[str, Any]:
    out = llama_cpp(site, {"op": "generate", "gguf": str(gguf), "threads": threads, "batch": batch,
                           "prompts": prompts, "max_new_tokens": max_new, "eos": sorted(eos)})
    seconds = out["prefill_s"] + out["decode_s"]
    return {**_rates(out["tokens"], seconds, out["prefill_s"], prompts), "llama_cpp": out["llama_cpp"],
            "system_info": out["system_info"]}


def _rates(tokens: list[list[int]], seconds: float, prefill_s: float | None,
           prompts: list[list[int]]) -> dict[str, Any]:
    generated = sum(map(len, tokens))
    prompt_tokens = sum(map(len, prompts))
    return {"tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds,
            "prefill_s": prefill_s, "prompt_tokens": prompt_tokens,
            "prompt_tokens_per_s": None if not prefill_s else prompt_tokens / prefill_s, "token_ids": tokens}


def same_rows(tokens: list[list[int]], reference: list[list[int]] | None) -> float | None:
    """The share of rows whose generated tokens equal the reference's (None without a reference)."""
    if reference is None:
        return None
    return sum(a == b for a, b in zip(tokens, reference)) / len(reference)


def quantized_copies(site: Path | None, gguf: Path, formats: list[str], folder: Path,
                     threads: int) -> dict[str, Path | str]:
    """The shipped file under its own type name, and each of `formats` re-quantized by llama.cpp into `folder`
    (a failure: its reason instead of a path)."""
    shipped = gguf.stem.rsplit(".", 1)[-1] if "." in gguf.stem else "shipped"
    copies: dict[str, Path | str] = {f"{shipped} (shipped)": gguf}
    for fmt in formats:
        dst = folder / f"{gguf.stem}.{fmt}.gguf"
        try:
            llama_cpp(site, {"op": "quantize", "src": str(gguf), "dst": str(dst), "ftype": fmt, "threads": threads})
            copies[fmt] = dst
        except RuntimeError as exc:
            copies[fmt] = str(exc)
    return copies


def best(runs: dict[str, dict[str, Any]]) -> tuple[str, float] | None:
    ok = [(r["tokens_per_s"], fmt) for fmt, r in runs.items() if "tokens_per_s" in r]
    return None if not ok else (max(ok)[1], max(ok)[0])


def bench_model(model: str, args: argparse.Namespace, site: Path | None, why: str) -> dict[str, Any]:
    record = new_record(BENCHMARK, WORKLOAD, model, device="cpu", commit=args.commit)
    probe = LLM(model, dtype="float32", device="cpu")
    prompts = encoded_prompts(probe, args.prompts, args.max_new_tokens)
    eos, pad = set(probe.eos_token_ids), probe.eos_token_ids[0]
    gguf = resolve_alias(model)
    del probe
    workdir = tempfile.TemporaryDirectory(prefix="cpu-peers-")
    copies = quantized_copies(site, gguf, args.llama, Path(workdir.name), args.threads) if site else {}
    batches: dict[str, Any] = {}
    for batch in args.batches:
        rows = prompts[:args.batch1_prompts] if batch == 1 else prompts
        runs: dict[str, dict[str, Any]] = {"ours": {}, "transformers": {}, "llama.cpp": {}}
        for form in args.ours:
            runs["ours"][form] = run_ours(model, form, rows, batch, args.max_new_tokens)
        for dtype in args.hf:
            runs["transformers"][dtype] = transformers_process(model, dtype, rows, batch, args.max_new_tokens, eos, pad,
                                                               args.threads)
        if site is None:
            runs["llama.cpp"] = {"skipped": why}
        for fmt, path in copies.items():
            runs["llama.cpp"][fmt] = (run_llama(site, path, rows, batch, args.max_new_tokens, eos, args.threads)
                                      if isinstance(path, Path) else {"skipped": path})
        reference = runs[REFERENCE[0]].get(REFERENCE[1], {}).get("token_ids")
        for side in runs.values():
            for run in side.values():
                if "token_ids" in run:
                    run["same_rows_as_ours_float32"] = same_rows(run.pop("token_ids"), reference)
        batches[str(batch)] = {"prompts": len(rows), "runs": runs, **_ratios(runs)}
        sys.stderr.write(f"{model} batch {batch}: {json.dumps(_ratios(runs))}\n")
    workdir.cleanup()
    largest = batches[str(max(args.batches))]
    ours = best(largest["runs"]["ours"])
    return {**record, "tokens_per_s": ours[1] if ours else None, "max_new_tokens": args.max_new_tokens,
            "threads": args.threads, "token_count": "generated tokens up to and including the end-of-generation id",
            "reference": "ours float32", "batches": batches, "load_average": os.getloadavg()}


def _ratios(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each side's best format and our best over theirs; prefill rates likewise; llama.cpp's shipped file."""
    bests = {side: best(r) for side, r in runs.items()}
    out: dict[str, Any] = {"best": {side: b and {"format": b[0], "tokens_per_s": b[1]} for side, b in bests.items()}}
    if bests["ours"]:
        ours = bests["ours"][1]
        out["ours_over"] = {side: ours / b[1] for side, b in bests.items() if b and side != "ours"}
        shipped = next((r for fmt, r in runs["llama.cpp"].items() if fmt.endswith("(shipped)") and "tokens_per_s" in r),
                       None)
        if shipped:
            out["ours_over"]["llama.cpp shipped file"] = ours / shipped["tokens_per_s"]
        prefill = [r["prompt_tokens_per_s"] for r in runs["llama.cpp"].values() if r.get("prompt_tokens_per_s")]
        ours_prefill = [r["prompt_tokens_per_s"] for r in runs["ours"].values() if r.get("prompt_tokens_per_s")]
        if prefill and ours_prefill:
            out["ours_over"]["llama.cpp prompt processing"] = max(ours_prefill) / max(prefill)
    return out


def main() -> None:
    if sys.argv[1:] == ["--transformers-worker"]:
        transformers_worker()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-0.5b-instruct",
                    help="model aliases; one whose packages are missing is recorded as skipped")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=8, help="prompts run one by one at batch 1")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--ours", default="auto,float32,bfloat16+w4,bfloat16+w4dense",
                    help="our forms: LLM dtype, +w4 for compress_weights, +w4dense for those with a dense copy")
    ap.add_argument("--hf", default="float32,bfloat16", help="transformers dtypes")
    ap.add_argument("--llama", default="Q4_0,Q8_0,BF16", help="llama.cpp formats re-quantized from the GGUF")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-cpp-site", type=Path, default=None,
                    help="a folder holding a built llama_cpp package (default: build or reuse the cached one)")
    ap.add_argument("--build-limit", type=float, default=BUILD_LIMIT_S, help="seconds the llama.cpp build may take")
    add_record_args(ap)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.ours, args.hf = [d for d in args.ours.split(",") if d], [d for d in args.hf.split(",") if d]
    args.llama = [f for f in args.llama.split(",") if f]
    torch.set_num_threads(args.threads)
    site, why = (args.llama_cpp_site, "") if args.llama_cpp_site else ensure_llama_cpp(limit_s=args.build_limit)
    for model in args.models.split(","):
        if model not in ALIASES or not alias_available(ALIASES[model]):
            record = new_record(BENCHMARK, WORKLOAD, model, device="cpu", commit=args.commit)
            save_record({**record, "skipped": f"model {model!r} is not installed"}, args.out)
            continue
        result = bench_model(model, args, site, why)
        save_record(result, args.out)
        sys.stdout.write(json.dumps({"model": model, **{b: r["ours_over"] for b, r in result["batches"].items()
                                                         if "ours_over" in r}}) + "\n")


if __name__ == "__main__":
    main()
