"""Offloading throughput, one harness: named workloads, our executor and its peers, each with its roofline.

Workloads (dummy weights from a preset, as the FlexGen paper measured):
    flexgen   OPT-30B (or --model opt-6.7b / opt-175b), prompt 512, gen 32: generated tokens/s
    wrangle   Llama-3-70B, rows of a 150-token shared prefix + 50 distinct tokens, gen 10: rows/h and the
              hours for 1M rows
    moe       Mixtral-8x7B (or --model mixtral-8x22b), 512 rows, prompt 77, gen 128: generated tokens/s
Systems (--system, repeatable): llmops (the executor under each --policy), llmops-no-pipeline (the same
policies with overlap off; for `moe`, the ablation of every pipelining: `Policy.pipeline=False`, host attention
synchronous and each layer's weights in one transfer, and `overlap=False`, no transfer overlapped with compute),
flexgen (FlexGen 0.1.8's OptLM, OPT only), accelerate
(HF Accelerate; --peer-rows / --peer-gen-len give it a smaller batch or fewer new tokens, recorded as run, with
its load_s, prefill_s, decode_step_s and projected_tokens_per_s_at_workload_gen: `throughput_peers.short_run_fields`);
a peer whose package or GPU is absent writes a record with `skipped` saying so. Policies (--policy, repeatable):
"auto" (the engine's search for this workload and budget, 4-bit allowed per --compress), a name from the
workload's suite (`SUITES`: named policies per model), or a Policy as JSON.

Every record (one JSONL line per system and configuration in benchmarks/records/<machine>/throughput.jsonl or
--out, all of one invocation sharing `run_id`) holds run_id, system, workload, model, prompt_len,
gen_len, num_prompts, gpu_memory_gib, tokens_per_s (generated tokens over prefill + decode wall time),
rows_per_h (wrangle; and rows_1m_h, and with three or more blocks rows_per_h_steady: the rows of the blocks
between the first and the last over their wall seconds, `block_s`; each of those holds one decode and one
prefill, its own or the next block's run ahead), roofline (the policy's floors, `roofline.py`), roofline_fraction
(floor time / measured time), peak_device_gib (torch's max allocated; None on a CPU), device, commit,
command, num_layers (--layers cuts the preset), weight_group_size (the inputs per min/scale pair of
compress_weights' 4-bit groups, `engine.models.weights.weight_quant`; a record without it ran groups of 32),
prefill_chunk_tokens, init_s and init_breakdown_s
(`WeightHomes.place_s`: placement's read / quantize / homes seconds), with --clock `step_clock` (per block, each
step as `engine.runtime.step_clock` saw it: host->device and device->host busy, compute, host gaps and waits,
the compute thread's time per action verb and how far the device runs behind it, collector time, allocator
retries), step_s (per block, each step's wall seconds: the prefill, then every decode step), block_s (each
measured block's wall seconds, from the start of the run or the previous block's end to its end), plan_rows
(--plan-rows: the job "auto" planned for, when it is not the rows run); with --profile also `profile`
(`engine.runtime.step_profile`: per layer, prefill and decode); with --trace also `trace`
(`benchmarks.common.trace_summary`: torch.profiler's kernel and copy seconds against the wall, syncs, top ops) and
`timeline` (`timeline.timeline_summary`: prefill and decode apart, each stream's busy time, the compute stream's
idle gaps, kernel seconds by category). A configuration cut by SIGTERM (`timeout`'s signal) still writes its
record: ok false, `cut` true, `error` naming the last progress phase, and `step_s` with the steps measured so far
(the block in flight last); the harness then exits 124 without starting another configuration.
Several GPUs (`--gpus N`, repeatable; `throughput_multi.py`): each llmops configuration runs once per N on
the same rows (default: one block per GPU of the largest N), and every record holds `num_gpus`, `parallel`
(pipeline / data), `micro_batches` (pipeline: blocks in flight), `tokens_digest` (sha256 of every row's greedy
tokens), and for N > 1 `tokens_match_1gpu`
and `speedup_vs_1gpu` (the 1-GPU record's wall time over this one's) when `--gpus 1` ran too; the roofline
floor of N GPUs is the one-GPU floor / N; `peak_device_gib` is the largest over the GPUs. `--one-device` puts
the N > 1 runs' stages on cuda:0 (the same code on one GPU: tokens must match, no speed-up expected).

    python benchmarks/throughput/throughput.py --workload flexgen --model opt-30b --gpu-memory 16GiB --policy auto \\
        --policy 4bit_w_cpu_cache_gpu_b48 --system llmops --system flexgen
    python benchmarks/throughput/throughput.py --workload wrangle --model llama-3-70b --rows 1536 --gpu-memory 16GiB
    python benchmarks/throughput/throughput.py --workload moe --gpu-memory 16GiB --policy auto --system llmops \
        --system llmops-no-pipeline
    python benchmarks/throughput/throughput.py --workload flexgen --model tiny-opt --prompt-len 16 --gen-len 4 \\
        --num-prompts 8 --gpu-memory none --profile --out /tmp/smoke.jsonl     # CPU smoke test
    NCCL_NVLS_ENABLE=0 python benchmarks/throughput/throughput.py --workload flexgen --model opt-30b --gpu-memory 16GiB \
        --policy 4bit_w_cpu_cache_gpu_48x1 --gpus 1 --gpus 2     # 1-GPU and 2-GPU records side by side
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from benchmarks.common import (GIB, Timer, add_record_args, close_and_release, failure_fields, new_record,  # noqa: E402
                               new_run_id, peak_gib, record_path, reset_peak, rewrite_jsonl, rows_per_hour, size_gib,
                               torch_device, trace_summary, with_layers)
from benchmarks.throughput.roofline import prefill_tokens, roofline  # noqa: E402
from benchmarks.throughput.throughput_multi import WARMUP_TOKENS, TokenRecorder, run_multi, tokens_digest  # noqa: E402
from benchmarks.throughput.throughput_peers import run_accelerate, run_flexgen, short_run_fields  # noqa: E402
from benchmarks.profiling.timeline import device_events, timeline_summary, write_events  # noqa: E402

import torch  # noqa: E402

from engine.calibrate.planning.choose import choose_policy_estimate  # noqa: E402
from engine.calibrate.machine import default_cpu_profile  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.models.presets import PRESETS  # noqa: E402
from engine.policy.cost_model import Workload  # noqa: E402
from engine.policy.hardware import reference_profile  # noqa: E402
from engine.policy.policy import Policy  # noqa: E402
from engine.policy.working import PREFILL_CHUNK_TOKENS  # noqa: E402
from engine.runtime.executor import Executor  # noqa: E402
from engine.runtime.step_clock import StepClock  # noqa: E402
from engine.runtime.step_profile import StepProfile  # noqa: E402
from engine.storage import device_cap  # noqa: E402
from engine.util.sizes import parse_size  # noqa: E402


WORKLOADS = {
    "flexgen": dict(model="opt-30b", prompt_len=512, gen_len=32, prefix_len=0, rows=None),
    "wrangle": dict(model="llama-3-70b", prompt_len=200, gen_len=10, prefix_len=150, rows=1536),
    "moe": dict(model="mixtral-8x7b", prompt_len=77, gen_len=128, prefix_len=0, rows=512),
}
SUITES: dict[str, dict[str, dict]] = {
    "opt-6.7b": {
        "all_gpu_b8": dict(gpu_batch_size=8, num_gpu_batches=1),
        "4bit_all_gpu_b96": dict(gpu_batch_size=32, num_gpu_batches=3, compress_weights=True, compress_cache=True),
        "w_cpu_cache_gpu_b32": dict(gpu_batch_size=16, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0),
        "w_half_cache_cpu_attn_b64": dict(gpu_batch_size=32, num_gpu_batches=2, w_gpu=0.5, w_cpu=0.5,
                                           cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True),
    },
    "opt-30b": {
        "w_cpu_cache_gpu_b12": dict(gpu_batch_size=6, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0),
        "4bit_w_cpu_cache_gpu_b48": dict(gpu_batch_size=16, num_gpu_batches=3, w_gpu=0.0, w_cpu=1.0,
                                         compress_weights=True, compress_cache=True),
        "4bit_w_cpu_cache_gpu_48x1": dict(gpu_batch_size=48, num_gpu_batches=1, w_gpu=0.0, w_cpu=1.0,
                                          compress_weights=True, compress_cache=True),
        "w_cpu_cache_cpu_attn_b32": dict(gpu_batch_size=16, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0,
                                          cache_gpu=0.0, cache_cpu=1.0, cpu_attention=True),
    },
    "opt-175b": {
        "4bit_w_disk30_cache_gpu": dict(gpu_batch_size=32, num_gpu_batches=1, w_gpu=0.0, w_cpu=0.7,
                                        compress_weights=True, compress_cache=True),
    },
}
# FlexGen's best measured policies per model: 4-bit weights on the CPU, 4-bit cache on the GPU
FLEXGEN_POLICIES = {
    "opt-6.7b": dict(gpu_batch_size=72, num_gpu_batches=1, percent=[100, 0, 100, 0, 100, 0], compress_weight=True,
                     compress_cache=True),
    "opt-30b": dict(gpu_batch_size=48, num_gpu_batches=1, percent=[0, 100, 100, 0, 100, 0], compress_weight=True,
                    compress_cache=True),
    "opt-175b": dict(gpu_batch_size=32, num_gpu_batches=1, percent=[0, 70, 100, 0, 100, 0], compress_weight=True,
                     compress_cache=True),
}


def make_prompts(vocab: int, rows: int, prompt_len: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    """`rows` token-id prompts of prompt_len tokens whose first prefix_len are shared."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(10, vocab - 1, (prefix_len,), generator=g).tolist()
    rest = torch.randint(10, vocab - 1, (rows, prompt_len - prefix_len), generator=g).tolist()
    return [prefix + r for r in rest]


def hw_profile(name: str, device: torch.device):
    """The profile the roofline and "auto" plan with: a reference machine, or the default CPU profile."""
    if name == "auto":
        return reference_profile("h200") if device.type == "cuda" else default_cpu_profile()
    return reference_profile(name)


def choose(args, config, device, dtype, profile, rows: int | None,
           prefix_len: int) -> tuple[str, Policy, dict | None]:
    """Yield (name, policy, predicted) for every --policy. "auto" plans as `LLM(policy="auto")` does unless
    --plan-profile says otherwise: on CUDA with this machine's measured (cached) profile and --trials
    measured trials of the best candidates; `profile` (the roofline's) only with --plan-profile reference.
    The planned workload's shared prefix is the prompts' (`prefix_len`), as the engine derives it; its row count
    is --plan-rows when given (a job larger than the rows measured: its first blocks), else `rows`."""
    for spec in args.policy or ["auto"]:
        if spec == "auto":
            cw, cc = {"on": (True, True), "off": (False, False), "auto": (None, None),
                      "weights": (True, None)}[args.compress]
            est = choose_policy_estimate(
                config, workload=Workload(args.prompt_len, args.gen_len, num_prompts=args.plan_rows or rows,
                                          shared_prefix_len=prefix_len), device=device,
                dtype=dtype, gpu_memory=args.gpu_memory, cpu_memory=args.cpu_memory, compress_weights=cw,
                compress_cache=cc,
                profile=profile if device.type == "cuda" and args.plan_profile == "reference" else None,
                trials=args.trials if device.type == "cuda" else 0)
            yield "auto", est.policy, {"tokens_per_s": est.predicted_tokens_per_s, "prefill_s": est.prefill_s,
                                       "decode_s": est.decode_s, "plan_profile": args.plan_profile,
                                       "trials": est.context.get("trials"),
                                       "model_predicted": est.context.get("predicted")}
        elif spec in SUITES.get(args.model, {}):
            yield spec, Policy.from_dict(SUITES[args.model][spec]), None
        else:
            yield "custom", Policy.from_dict(json.loads(spec)), None


_START = time.perf_counter()
_PHASE = ["starting"]          # the last progress message: where a cut configuration was


class Cut(Exception):
    """SIGTERM (what `timeout` sends) arrived during a configuration: it is recorded as cut, with the phase it
    had reached and the step seconds it had measured, and the harness then exits 124 without starting another."""


def _cut(signum: int, frame) -> None:
    raise Cut(f"terminated by signal {signum} {time.perf_counter() - _START:.1f} s after the start, during: "
              f"{_PHASE[0]}")


def device_tracer(on: bool):
    """torch.profiler over the measured blocks when `on` (CPU and CUDA activities), else a no-op context."""
    if not on:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def progress(message: str) -> None:
    """One line on stderr with the seconds since the harness started; the last one is a cut record's phase."""
    _PHASE[0] = message
    print(f"[throughput {time.perf_counter() - _START:7.1f} s] {message}", file=sys.stderr, flush=True)


RECORD_KEY = ("run_id", "commit", "system", "config_name", "num_gpus", "workload", "model", "num_layers",
              "prompt_len", "gen_len", "num_prompts", "gpu_memory_gib", "prefill_chunk_tokens", "plan_rows")
"""The fields naming one configuration of one run: a rerun of it replaces its record, any other (another commit
of an A/B, another shape of a suite run sharing LLMOPS_RUN_ID) is appended; the shape is part of the key, so one
shape's record never replaces another's."""


def run_llmops(loaded, policy: Policy, prompts: list[list[int]], args, device, dtype) -> dict:
    """Blocks of policy.block_size rows through one executor (a warm-up block of WARMUP_TOKENS first), with
    torch's caching allocator capped at --gpu-memory for the run (`engine.storage.device_cap`, as `LLM` does:
    the budget then holds for reserved memory too, not only for what the executor counts)."""
    cuda = device.type == "cuda"
    out: dict = {"policy": policy.to_dict(), "allocator_cap_gib": size_gib(args.gpu_memory) if cuda else None}
    ex = None
    step_walls: list[list[float]] = []     # per measured block, each step's wall seconds
    block_walls: list[float] = []          # per measured block, its wall seconds
    clock: StepClock | None = None         # with --clock: the measured blocks' steps (`clocked`, per block)
    clocked: list[list[dict]] = []
    finished: list[float] | None = None    # while measuring: the executor's step list before the block in flight
    cap = device_cap.hold(device, args.gpu_memory)       # torch's allocator capped at the budget, as LLM does
    try:
        progress(f"placing weights for {policy.gpu_batch_size}x{policy.num_gpu_batches} ({len(prompts)} rows)")
        with Timer() as init:
            ex = Executor(loaded, policy, device=device, dtype=dtype, gpu_memory=args.gpu_memory,
                          cpu_memory=args.cpu_memory, disk_dir=args.disk_dir,
                          prefill_chunk_tokens=args.prefill_chunk_tokens)
        out["init_s"] = init.seconds
        out["init_breakdown_s"] = {k: round(v, 3) for k, v in ex.weights.place_s.items()}
        n = policy.block_size
        blocks = [prompts[s:s + n] for s in range(0, len(prompts), n)]
        if args.warmup:
            progress(f"placed in {init.seconds:.1f} s; warm-up block")
            ex.generate_block(blocks[0], [WARMUP_TOKENS] * len(blocks[0]), TokenRecorder())
        prof = StepProfile(device, [s.kind for s in ex.specs]) if args.profile else None
        ex.profiler = prof
        clock = ex.transfers.clock = StepClock() if args.clock and cuda else None
        reset_peak()
        recorders, prefill, decode, steps, ahead = [TokenRecorder() for _ in blocks], 0.0, 0.0, 0, 0
        finished = ex.step_s                     # the warm-up's (each block starts a new list)
        tracer = device_tracer(args.trace and cuda)
        with tracer, Timer() as run:              # the timer stops before the profiler's teardown
            progress(f"block 1/{len(blocks)}: {len(blocks[0])} rows x {args.gen_len} new tokens")
            mark = time.perf_counter()
            for _ in ex.generate_blocks((block, [args.gen_len] * len(block), rec)
                                        for block, rec in zip(blocks, recorders)):
                prefill, decode, steps = prefill + ex.stats["prefill_s"], decode + ex.stats["decode_s"], steps + 1
                ahead += int(ex.stats.get("prefill_ahead", 0.0))
                step_walls.append([round(x, 4) for x in ex.step_s])
                if clock is not None:
                    clocked.append(clock.take())
                block_walls.append(round(time.perf_counter() - mark, 4))
                mark = time.perf_counter()
                finished = ex.step_s
                nxt = f"; block {steps + 1}/{len(blocks)}" if steps < len(blocks) else ""
                progress(f"block {steps} done: prefill {ex.stats['prefill_s']:.1f} s"
                         f"{' (ran ahead)' if ex.stats.get('prefill_ahead') else ''}, decode {ex.stats['decode_s']:.1f} s{nxt}")
        if args.trace and cuda:
            out["trace"] = trace_summary(tracer, run.seconds)
            events, marks = device_events(tracer)
            out["timeline"] = timeline_summary(events, marks)
            if args.trace_out:
                write_events(args.trace_out, events, marks)
        out.update(ok=True, total_s=run.seconds, prefill_s=prefill, decode_s=decode, blocks=steps, step_s=step_walls,
                   block_s=block_walls, block_rows=[len(b) for b in blocks], blocks_prefilled_ahead=ahead,
                   generated_tokens=sum(r.tokens for r in recorders), tokens_digest=tokens_digest(recorders),
                   executor_memory=ex.memory_report(), **peak_gib())
        if prof is not None:
            out["profile"] = prof.report()
        if clock is not None:
            out["step_clock"] = clocked
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError, ValueError) as err:
        out.update(failure_fields(err))
    except Cut as err:            # the measured blocks' steps so far, the block in flight last (its own so far)
        begun = finished is not None and ex.step_s is not finished
        in_flight = [[round(x, 4) for x in ex.step_s]] if begun else []
        out.update(failure_fields(err), cut=True, step_s=step_walls + in_flight)
        if clock is not None:
            out["step_clock"] = clocked + ([clock.take()] if begun else [])
    finally:
        close_and_release(ex)
        device_cap.release(cap)
    return out


def finish(record: dict, res: dict, rows: int, floor: dict | None, wrangle: bool) -> dict:
    """Fill the common metric fields from one run's result."""
    record.update(res)
    total = res.get("total_s")
    if res.get("ok") and total:
        record["tokens_per_s"] = res["generated_tokens"] / total
        record["decode_step_s"] = res["decode_s"] / max(1, res.get("blocks", 1) * (record["gen_len"] - 1)) \
            if res.get("decode_s") else None
        if wrangle:
            record["rows_per_h"] = rows_per_hour(rows, total)
            record["rows_1m_h"] = 1e6 / record["rows_per_h"] if record["rows_per_h"] else None
            middle, rows_middle = res.get("block_s", [])[1:-1], sum(res.get("block_rows", [])[1:-1])
            record["rows_per_h_steady"] = rows_per_hour(rows_middle, sum(middle)) if middle else None
        if floor is not None:
            record["roofline"] = floor
            record["roofline_fraction"] = floor["floor_s"] / total
    return record


def guarded(run, *a, **kw) -> dict:
    """`run(*a, **kw)`'s result dict, or a cut configuration's failure fields when SIGTERM arrives during it."""
    try:
        return run(*a, **kw)
    except Cut as err:
        return {**failure_fields(err), "cut": True}


def main(argv: list[str] | None = None) -> list[dict]:
    """The harness (see the module doc). SIGTERM during a configuration writes its record with `cut` true (the
    phase reached, the steps measured) and exits 124; SIGTERM between records exits 124 with a message."""
    previous = signal.signal(signal.SIGTERM, _cut)
    try:
        return _main(argv)
    except Cut as err:
        print(f"throughput: {err}", file=sys.stderr, flush=True)
        raise SystemExit(124) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="flexgen")
    ap.add_argument("--model", default=None, help="dummy preset (default: the workload's)")
    ap.add_argument("--system", action="append", choices=["llmops", "llmops-no-pipeline", "flexgen", "accelerate"])
    ap.add_argument("--policy", action="append", help='"auto", a suite name or a Policy as JSON (repeatable)')
    ap.add_argument("--compress", choices=["on", "off", "auto", "weights"], default="on",
                    help="4-bit for --policy auto: on (weights and cache), off, auto (the search decides both), "
                         "weights (4-bit weights; the search decides the cache, e.g. a 16-bit host cache for CPU "
                         "attention)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--gen-len", type=int, default=None)
    ap.add_argument("--prefix-len", type=int, default=None, help="shared leading tokens (wrangle: 150)")
    ap.add_argument("--num-prompts", "--rows", dest="rows", type=int, default=None,
                    help="rows (default: wrangle 1536; flexgen one block of the policy)")
    ap.add_argument("--plan-rows", type=int, default=None,
                    help='the job "auto" plans for (default: the rows run), e.g. 1000000 measured on its first blocks')
    ap.add_argument("--gpu-memory", default="16GiB", help='a size, or "none"')
    ap.add_argument("--cpu-memory", default=None)
    ap.add_argument("--disk-dir", default="/tmp/llmops-offload")
    ap.add_argument("--hw-profile", default="auto", help='"auto" (h200 on CUDA, default CPU profile) or "h200"')
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--plan-profile", choices=["measured", "reference"], default="measured",
                    help='"auto" plans with this machine\'s measured profile (as LLM does) or the --hw-profile')
    ap.add_argument("--trials", type=int, default=4,
                    help='measured trials of the best candidates for "auto" on CUDA (LLM\'s default: 4)')
    ap.add_argument("--profile", action="store_true", help="write the per-layer step profile (serializes overlap)")
    ap.add_argument("--clock", action="store_true",
                    help="per step, the device's view without synchronizing inside it (CUDA, "
                         "`engine.runtime.step_clock`): transfer and compute busy seconds, host gaps, host waits")
    ap.add_argument("--trace", action="store_true",
                    help="torch.profiler over the measured blocks (CUDA): kernel vs wall seconds, syncs, top ops, "
                         "and the timeline by phase (`profiling/timeline.py`)")
    ap.add_argument("--trace-out", type=Path, default=None,
                    help="with --trace: also the compact device timeline here (gzip JSON, `timeline.write_events`)")
    ap.add_argument("--layers", type=int, default=None,
                    help="the preset cut to its first N decoder layers (per-layer costs, a fraction of the init)")
    ap.add_argument("--prefill-chunk-tokens", type=int, default=PREFILL_CHUNK_TOKENS,
                    help="tokens per prefill row chunk (the executor's; auto plans with the default)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--gpus", type=int, action="append",
                    help="GPUs of this host (repeatable, e.g. --gpus 1 --gpus 2: both on the same rows, whose "
                         "default count is then one block per GPU of the largest N); N > 1 runs pipeline stages "
                         "(or data-parallel lanes when the policy keeps every weight on the GPU); without CUDA, "
                         "N CPU devices")
    ap.add_argument("--one-device", action="store_true",
                    help="the N > 1 runs put every stage or lane on cuda:0 (the same code on a machine of one GPU)")
    ap.add_argument("--peer-rows", type=int, default=None, help="accelerate's batch (default: the rows, or 16)")
    ap.add_argument("--peer-gen-len", type=int, default=None, help="accelerate's new tokens (default: --gen-len)")
    add_record_args(ap)
    args = ap.parse_args(argv)
    w = WORKLOADS[args.workload]
    args.model = args.model or w["model"]
    args.prompt_len = args.prompt_len or w["prompt_len"]
    args.gen_len = args.gen_len or w["gen_len"]
    prefix_len = w["prefix_len"] if args.prefix_len is None else args.prefix_len
    prefix_len = min(prefix_len, args.prompt_len - 1)
    gpu_text = None if args.gpu_memory in (None, "none") else args.gpu_memory
    args.gpu_memory = parse_size(gpu_text) if gpu_text else None
    args.cpu_memory = parse_size(args.cpu_memory) if args.cpu_memory else None
    device, dtype = torch_device(), getattr(torch, args.dtype)
    dtype = dtype if device.type == "cuda" else torch.float32
    profile = hw_profile(args.hw_profile, device)
    out = args.out or record_path("throughput")
    run_id, wrangle = new_run_id(), args.workload == "wrangle"
    progress(f"loading {args.model}")
    loaded = load_model(args.model, dtype=dtype)
    if args.layers:
        loaded = with_layers(loaded, args.layers)
    config = loaded.config
    rows_arg = args.rows if args.rows is not None else w["rows"]
    args.plan_rows = args.plan_rows if args.plan_rows != rows_arg else None
    records = []

    gpus = sorted(set(args.gpus or [1]))

    def emit(system: str, name: str, res: dict, rows: int, floor: dict | None, num_gpus: int = 1) -> dict:
        rec = new_record("throughput", args.workload, args.model, system=system, gpu_memory=gpu_text,
                         commit=args.commit, run_id=run_id)
        rec.update(prompt_len=args.prompt_len, gen_len=args.gen_len, num_prompts=rows, prefix_len=prefix_len,
                   config_name=name, roofline_fraction=None, num_gpus=num_gpus, num_layers=config.num_hidden_layers,
                   prefill_chunk_tokens=args.prefill_chunk_tokens, plan_rows=args.plan_rows,
                   weight_group_size=config.weight_group_size)
        rec = finish(rec, res, rows, floor, wrangle)
        rewrite_jsonl(out, rec, RECORD_KEY)
        records.append(rec)
        print(json.dumps({k: rec.get(k) for k in ("system", "config_name", "ok", "skipped", "tokens_per_s",
                                                  "rows_per_h", "roofline_fraction", "peak_device_gib", "error",
                                                  "num_gpus", "tokens_match_1gpu", "speedup_vs_1gpu")}),
              flush=True)
        if res.get("cut"):
            raise SystemExit(124)
        return rec

    planned: list[tuple[str, Policy, dict | None]] = []     # --policy resolved once: every system runs the same
    for system in args.system or ["llmops"]:
        if system in ("llmops", "llmops-no-pipeline"):
            planned = planned or list(choose(args, config, device, dtype, profile, rows_arg, prefix_len))
            for name, policy, predicted in planned:
                if system == "llmops-no-pipeline":
                    off = {"pipeline": False, "overlap": False} if args.workload == "moe" else {"overlap": False}
                    policy = Policy.from_dict({**policy.to_dict(), **off})
                rows = rows_arg or policy.block_size * max(gpus)
                prompts = make_prompts(config.vocab_size, rows, args.prompt_len, prefix_len)
                floor = roofline(config, policy, profile, rows=rows,
                                 prefill_tokens=prefill_tokens(rows, args.prompt_len, prefix_len, policy.gpu_batch_size),
                                 prompt_len=args.prompt_len, gen_len=args.gen_len, prefix_len=prefix_len,
                                 bytes_per_element=torch.empty((), dtype=dtype).element_size())
                one: dict | None = None
                for n in gpus:
                    res = run_llmops(loaded, policy, prompts, args, device, dtype) if n == 1 else \
                        guarded(run_multi, loaded, policy, prompts, args, n, dtype)
                    res["predicted"] = predicted
                    if one is not None and res.get("ok") and one.get("ok"):
                        res["tokens_match_1gpu"] = res["tokens_digest"] == one["tokens_digest"]
                        res["speedup_vs_1gpu"] = one["total_s"] / res["total_s"]
                    n_floor = None if floor is None else {**floor, "floor_s": floor["floor_s"] / n, "num_gpus": n}
                    shape = f"{policy.gpu_batch_size}x{policy.num_gpu_batches}{'+ahead' if policy.prefill_ahead else ''}"
                    rec = emit(system, f"{name}:{shape}", res, rows,
                               n_floor, n)
                    one = rec if n == 1 else one
        elif system == "flexgen":
            fp = FLEXGEN_POLICIES.get(args.model, {})
            rows = fp.get("gpu_batch_size", 1) * fp.get("num_gpu_batches", 1)
            prompts = make_prompts(config.vocab_size, rows, args.prompt_len, prefix_len)
            res = guarded(run_flexgen, args.model, prompts, args.gen_len, fp, args.disk_dir) if fp else \
                {"ok": False, "skipped": f"no FlexGen policy for {args.model}"}
            emit(system, "best-measured", res, rows, None)
        else:
            rows = args.peer_rows or rows_arg or 16
            gen = args.peer_gen_len or args.gen_len
            prompts = make_prompts(config.vocab_size, rows, args.prompt_len, prefix_len)
            res = guarded(run_accelerate, args.model, prompts, gen, args.gpu_memory or 16 * GIB, rows,
                          PRESETS[args.model], say=progress)
            res.update(short_run_fields(res, rows, gen, args.gen_len))
            emit(system, f"b{rows}-gen{gen}", res, rows, None)
    return records


if __name__ == "__main__":
    main()
