"""The engine facade: `LLM(model, ...)`, `.plan(prompts or workload, params)`, `.generate(...)` and `.stream(...)`.

Flow of one call: encode prompts (engine.decoding.prompts) -> per-prompt errors set aside -> the job's plan for the
valid prompts' lengths (engine.calibrate.planning: a plan given by the caller when it covers them, else one
per workload bucket, chosen once and reused) -> sort by length and cut into blocks of the
policy's block size (engine.decoding.blocks) -> per block, the warm executor runs prefill + decode while a `BlockDecoder` picks tokens
-> completions mapped back to the caller's order. `stream` yields each block's completions as soon as the
block is done. `gpu_memory` caps torch's allocator on the device (engine.storage.device_cap), so planning,
trials and warm-up stay inside the budget too. With several `devices` (engine.parallel) a plan's blocks run
data-parallel (one executor per device, whole blocks each) or pipeline-parallel (the layers split over the
devices, `engine.runtime.pipeline`), chosen per plan. `LLM.stats` (engine.runtime.run_stats) counts where the time
went (load, placing weights, planning, prefill, decode, grammar masks, the caller's hook) and the peak
memory per tier of the latest call.
"""
from __future__ import annotations

import functools
import logging
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from engine.calibrate.cpu_dtype import int4_dense_max_rows, int4_max_rows
from engine.calibrate.planning import (
    Plan, Planner, PlanSettings, bucketed, bucketed_workload, compute_dtype, planning_profile, prompts_prefix_len,
    size_setting,
)
from engine.decoding.blocks import plan_blocks
from engine.decoding.constrain import GrammarConstraint
from engine.decoding.decoder import BlockDecoder
from engine.decoding.params import Completion, SamplingParams
from engine.decoding.prompts import Encoded, encode_prompts
from engine.decoding.sampling import sequence_keys
from engine.decoding.tokenizer import MarkedText, Tokenizer
from engine.fingerprint import output_fingerprint, tokenizer_digest
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.parallel import (
    DeviceSpec, Lanes, Parallel, build_pipeline, choose_parallel, locked, resolve_devices, run_blocks,
)
from engine.policy.cost_model import Workload
from engine.policy.policy import Policy, as_policy
from engine.runtime import executor as executor_mod
from engine.runtime.embed import Embedder, Embedding
from engine.runtime.run_stats import EngineStats
from engine.storage import device_cap
from engine.util.host_heap import reserve_huge_heap

log = logging.getLogger(__name__)

Group = list[tuple[int, Completion]]
OnFinished = Callable[[int, Completion], None]
OnStep = Callable[[int], None]


def once_per_row(on_finished: OnFinished | None) -> OnFinished | None:
    """`on_finished` called at most once per input row: a block whose prefill ran ahead may have finished rows
    at their first token before an out-of-memory fallback reruns it, and those rows are not reported again."""
    if on_finished is None:
        return None
    reported: set[int] = set()

    def report(index: int, completion: Completion) -> None:
        if index not in reported:
            reported.add(index)
            on_finished(index, completion)
    return report


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when available, else cpu."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _weak_call(method: Callable[[], Any]) -> Callable[[], None]:
    """`method` called through a weak reference (a bound method held by a member would make a cycle that
    keeps the engine, and its device memory, alive until the cyclic collector runs)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()
    return call


class LLM:
    """An open LLM on this machine's tiers, generating for many prompts at once.

    policy: "auto" (planned once per workload bucket by `engine.calibrate.planning`: the cost model's choice,
    kept in the plan cache), a `Policy` or a Policy dict.
    gpu_memory / cpu_memory: hard budgets in bytes or strings like "16GiB" (None: planned within the
    defaults of `engine.calibrate.planning.settings.resolve_budgets`, from the hardware profile: the device's
    memory, `PINNED_SHARE` of the host's available RAM). On CUDA, gpu_memory also caps torch's allocator on
    the device for as long as this LLM lives.
    trials: on a GPU, the job's first run of a plan the cost model chose measures its best `trials`
    candidates on truncated copies of the model and keeps the fastest, in the plan cache (0: the cost model
    decides alone).
    disk_dir: folder for the disk tier. dtype: "auto" = bfloat16 on CUDA (float16 without bf16), the
    faster of bfloat16/float32 on a CPU (measured once per machine, cached: engine.calibrate.cpu_dtype).
    compress_weights: hold the decoder matmul weights 4-bit (`engine.models.weights.weight_quant`: groups of 64,
    a GGUF's of 32). An AWQ / GPTQ int4 checkpoint's packed weights are 4-bit in its own groups whatever this
    says (never expanded to dense, never re-quantized); the flag then only compresses decoder weights the
    checkpoint left in float.
    devices: None (just `device`), "auto" (every visible CUDA device) or a list of CUDA indices / torch device
    strings; with more than one, `gpu_memory` holds on each, each device plans and runs within 1/N of the
    host's budgets, and `parallel` says how blocks use them: "auto" (data-parallel when the plan keeps every
    weight on the gpu tier, else pipeline), "data" or "pipeline" (engine.parallel).
    """

    def __init__(self, model: str | Path, *, policy: str | Policy | dict[str, Any] = "auto",
                 gpu_memory: int | str | None = None, cpu_memory: int | str | None = None,
                 disk_dir: str | Path | None = None, dtype: str | torch.dtype = "auto",
                 compress_weights: bool = False, compress_cache: bool = False, device: str = "auto",
                 devices: DeviceSpec = None, parallel: Parallel = "auto", trials: int = 0) -> None:
        try:
            policy = as_policy(policy)
        except ValueError as exc:
            raise ValueError(f"LLM(policy=...): {exc}") from None
        began = time.perf_counter()
        self.stats = EngineStats()
        self.devices = resolve_devices(devices, resolve_device(device))
        self.device = self.devices[0]
        choose_parallel(parallel, Policy(), len(self.devices))    # a bad value raises now, before loading
        self.parallel = parallel
        self.dtype = compute_dtype(dtype, self.device.type)
        self.gpu_memory = size_setting("gpu_memory", gpu_memory)
        self.cpu_memory = size_setting("cpu_memory", cpu_memory)
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        settings = PlanSettings(gpu_memory=self.gpu_memory, cpu_memory=self.cpu_memory, disk_dir=self.disk_dir,
                                num_devices=len(self.devices), parallel=parallel, compress_weights=compress_weights,
                                compress_cache=compress_cache, trials=trials)
        self.compress_weights = compress_weights
        self.compress_cache = compress_cache
        self.model_name = Path(str(model)).name
        if self.device.type == "cpu":
            reserve_huge_heap()         # before the weights are placed: they and the caches land on huge pages
        self.loaded = load_model(model, dtype=self.dtype)
        tok_dir = self.loaded.tokenizer_dir
        self._tokenizer = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
        eos = set(self.loaded.config.eos_token_id)
        if self._tokenizer is not None:
            eos |= set(self._tokenizer.eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self._policy: Policy | None = None
        self._plan: Plan | None = None
        device0 = self.device
        self._planner = Planner(self.loaded.config, settings, dtype=self.dtype,
                                profile=lambda: planning_profile(device0), model_name=self.model_name,
                                fixed=policy if isinstance(policy, Policy) else None, device=self.device,
                                before_trials=_weak_call(self.close))
        self._downsized: dict[Policy, Policy] = {}    # planned policy -> the smaller one an out-of-memory forced
        self._executor: Any = None
        self._parallel: Lanes | Any = None        # the Lanes or Pipeline of several devices, when in use
        self._executor_policy: Policy | None = None
        self._embedder: Embedder | None = None    # the weights an `embed` call holds, until the next generation
        for dev in self.devices:
            weakref.finalize(self, device_cap.release, device_cap.hold(dev, self.gpu_memory))
        self.stats.load_s = time.perf_counter() - began

    # ---- properties
    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        """Prompt tokens + new tokens a sequence may hold (config.max_position_embeddings)."""
        return self.loaded.config.max_position_embeddings

    @property
    def policy(self) -> Policy | None:
        """The policy of the last generate/stream call (None before the first)."""
        return self._policy

    @property
    def last_plan(self) -> Plan | None:
        """The plan of the last generate/stream/plan call (None before the first)."""
        return self._plan

    @functools.cached_property
    def fingerprint(self) -> str:
        """Stable id of what produces the outputs (a result-cache key), `engine.fingerprint.output_fingerprint`:
        model weights, tokenizer and chat template, dtype, compression, EOS ids and the engine's
        `NUMERICS_VERSION`. Computed once per LLM (reads tokenizer.json)."""
        return output_fingerprint(self.loaded.fingerprint, tokenizer_digest(self._tokenizer), self.dtype,
                                  compress_weights=self.compress_weights, compress_cache=self.compress_cache,
                                  eos_token_ids=self.eos_token_ids)

    def prompt_tokens(self, prompts: Sequence[Any], params: SamplingParams | None = None) -> list[int]:
        """How many tokens each prompt encodes to (chat template, the model's built-in system prompt and
        few-shot turns included), as `stream` would encode it; nothing runs. 0 for a prompt that cannot be
        encoded (a template failure)."""
        params = self._check(prompts, params)
        encoded = encode_prompts(prompts, params, self._tokenizer, self.loaded.config.vocab_size, self.max_context)
        return [len(e.ids) for e in encoded]

    def embed(self, texts: Sequence[str]) -> list[Embedding]:
        """One `Embedding` per text, in order: a unit-length vector (`engine.runtime.embed`: the mean of the last
        decoder layer's hidden states, so cosine similarity is a dot product), or an error for a text that
        cannot run (empty, longer than the context). A pure forward pass: no chat template, nothing generated.
        Texts are data (a special-token string in one is plain text). The whole model but its output head is
        held on the device from the first call until the next generation or `close` (the executor's copy is
        released first, so one copy lives at a time); a model that does not fit `gpu_memory` raises ValueError."""
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a list of strings")
        if self._tokenizer is None:
            raise ValueError("embed needs a tokenizer; this model has none")
        ids = self._tokenizer.encode_marked_batch([MarkedText(t, ((0, len(t)),)) for t in texts])
        errors = [("empty text" if not t.strip() else None) if len(x) <= self.max_context else
                  f"text of {len(x)} tokens exceeds the context of {self.max_context}" for t, x in zip(texts, ids)]
        if self._embedder is None:
            self.close()
            embedder = Embedder(self.loaded, self.device, self.dtype)
            why = embedder.fits(self.gpu_memory if self.device.type == "cuda" else None)
            if why is not None:
                raise ValueError(why)
            self._embedder = embedder
        run = [i for i, e in enumerate(errors) if e is None]
        vectors = self._embedder.embed([ids[i] for i in run]).tolist() if run else []
        out = [Embedding(None, len(x), e) for x, e in zip(ids, errors)]
        for i, v in zip(run, vectors):
            out[i] = Embedding(v, len(ids[i]))
        return out

    # ---- generation
    def generate(self, prompts: Sequence[Any], params: SamplingParams | None = None, *,
                 plan: Plan | None = None) -> list[Completion]:
        """One Completion per prompt, in input order. Per-prompt problems are error completions."""
        out: list[Completion | None] = [None] * len(prompts)
        for group in self.stream(prompts, params, plan=plan):
            for index, completion in group:
                out[index] = completion
        return out  # type: ignore[return-value]

    def stream(self, prompts: Sequence[Any], params: SamplingParams | None = None, *,
               plan: Plan | None = None, on_finished: OnFinished | None = None,
               on_step: OnStep | None = None) -> Iterator[Group]:
        """Yield lists of (input index, Completion): first the prompts that cannot run, then one list per
        block as it finishes. Every index is yielded exactly once. Type and parameter errors raise here,
        before any work. `plan` (from `plan()` or an earlier call's `last_plan`) is used when it covers
        these prompts; otherwise the plan of their workload bucket is (planned once, then reused).

        `on_finished(index, completion)`, when given, is called as each generated row finishes, from the
        decode loop, before its block ends (a row that stops at EOS early is reported then); it must be
        quick (e.g. hand the row to a buffer) and an exception it raises aborts the call. The yielded
        groups do not change: each index is still yielded once, with its block, and for a row reported
        early with the same Completion. Prompts that cannot run are yielded first and not reported; a
        row may be reported twice when its block is retried after an out-of-memory (the retry's completion
        is the one yielded).

        `on_step(tokens)`, when given, is called from the decode loop each time tokens are chosen for a GPU
        batch (its first tokens after its prefill, then one per decode step), with how many were chosen
        (`engine.decoding.decoder`): a progress display moves while a block decodes. It must be quick, an
        exception it raises aborts the call, and with several devices it is serialized like `on_finished`."""
        params = self._check(prompts, params)
        encoded = encode_prompts(prompts, params, self._tokenizer, self.loaded.config.vocab_size, self.max_context)
        if any(e.error is None for e in encoded):
            self._constraint(params, 1)  # invalid grammar: raise now
        return self._run(encoded, params, plan, on_finished, on_step)

    def plan(self, workload: Workload | Sequence[Any], params: SamplingParams | None = None, *,
             covering: Plan | None = None, rows: int | None = None, measure: bool = True) -> Plan:
        """The plan a job runs with, planned in the bucket of its workload; nothing is generated.

        `workload`: the job's prompts (strings, messages or token ids, as for `stream`; `params` gives
        their max_new_tokens and how they are encoded) or a `Workload` (prompt-length statistics and new
        tokens; `params` is then not used). `rows`: the job's row count when the prompts are a sample of it
        (their lengths stand for all rows, and the tokens they all share for the prefix all rows share: this
        is checked per call, not trusted: a call whose prompts share less is not covered by the plan, which
        is then re-planned with the smaller prefix, `Planner.plan_for`). `covering`: a plan to keep when it
        covers these prompts, else the new plan covers both.
        The plan is one this process or the plan cache holds, else the cost model's choice (see
        `engine.calibrate.planning`); with `trials`, a plan the cost model chose is refined by trials
        first. `measure=False` (a preview: `llmops run --dry-run`) never runs trials: the plan then says
        whether the run will (`Plan.pending_trials`). Run the job with it: `generate(..., plan=plan)`."""
        if isinstance(workload, Workload):
            bucket = bucketed_workload(workload)
        else:
            params = self._check(workload, params)
            encoded = encode_prompts(workload, params, self._tokenizer, self.loaded.config.vocab_size,
                                     self.max_context)
            ids = [e.ids for e in encoded if e.error is None]
            bucket = bucketed([len(p) for p in ids], params.max_new_tokens, prompts_prefix_len(ids), rows=rows)
        if not measure:
            began = time.perf_counter()
            preview = self._planner.plan(bucket, measure=False)
            self.stats.plan_s += time.perf_counter() - began
            return preview
        return self._plan_for(bucket, covering)

    def _check(self, prompts: Sequence[Any], params: SamplingParams | None) -> SamplingParams:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list, got {type(prompts).__name__}")
        if params.stop and self._tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; this model has none")
        return params

    def _run(self, encoded: list[Encoded], params: SamplingParams, plan: Plan | None,
             on_finished: OnFinished | None = None, on_step: OnStep | None = None) -> Iterator[Group]:
        errors = [(i, Completion("", finish_reason="error", prompt_tokens=len(e.ids), error=e.error))
                  for i, e in enumerate(encoded) if e.error is not None]
        if errors:
            yield errors
        valid = [i for i, e in enumerate(encoded) if e.error is None]
        if not valid:
            return
        self.stats.peak_bytes = dict.fromkeys(self.stats.peak_bytes, 0)   # peaks are the latest call's
        keys = sequence_keys(params.seed, [e.ids for e in encoded]) if params.temperature > 0 else None
        lens = [len(encoded[i].ids) for i in valid]
        bucket = bucketed(lens, params.max_new_tokens, prompts_prefix_len([encoded[i].ids for i in valid]))
        plan = self._plan_for(bucket, plan)
        policy = self._downsized.get(plan.policy, plan.policy)
        self._set_policy(policy)
        blocks = [[valid[b] for b in block] for block in plan_blocks(lens, policy.block_size)]
        mode = choose_parallel(self.parallel, policy, len(self.devices))
        if mode != "single":
            yield from self._run_parallel(mode, blocks, encoded, params, keys, on_finished, on_step)
            return
        done = 0
        if policy.prefill_ahead and len(blocks) > 1:
            on_finished = once_per_row(on_finished)
            for group in self._run_ahead(blocks, encoded, params, keys, on_finished, on_step):
                done += 1
                yield group
        for indices in blocks[done:]:
            report = None if on_finished is None else (
                lambda row, c, indices=indices: on_finished(indices[row], c))  # block row -> input index
            completions = self._run_block([encoded[i].ids for i in indices], params,
                                          None if keys is None else [keys[i] for i in indices], report, on_step)
            yield list(zip(indices, completions))

    def _run_ahead(self, blocks: list[list[int]], encoded: list[Encoded], params: SamplingParams,
                   keys: list[int] | None, on_finished: OnFinished | None,
                   on_step: OnStep | None = None) -> Iterator[Group]:
        """Blocks through one `Executor.generate_blocks` stream, each block's prefill run ahead on the previous
        block's decode (`Policy.prefill_ahead`), yielded as each ends. On out-of-memory it stops; `_run` runs
        the blocks not yielded one by one (`_run_block` halves the batch), so no finished block is lost."""
        decoders: dict[int, BlockDecoder] = {}

        def feed():
            for n, indices in enumerate(blocks):
                report = None if on_finished is None else (
                    lambda row, c, indices=indices: on_finished(indices[row], c))
                decoders[n] = self._decoder([encoded[i].ids for i in indices], params,
                                            None if keys is None else [keys[i] for i in indices], report, on_step)
                yield [encoded[i].ids for i in indices], decoders[n].max_new_tokens, decoders[n]

        executor = self._get_executor()
        try:
            for n in executor.generate_blocks(feed()):
                decoder = decoders.pop(n)
                completions = decoder.completions()
                self._count_block(executor, decoder, completions)
                yield list(zip(blocks[n], completions))
        except torch.OutOfMemoryError:
            log.warning("out of memory with the ahead prefill; running the remaining blocks one by one")

    def _run_block(self, prompts: list[list[int]], params: SamplingParams, keys: list[int] | None,
                   on_finished: OnFinished | None = None, on_step: OnStep | None = None) -> list[Completion]:
        """Generate one block; on out-of-memory, halve the GPU batch size and rerun the block in pieces of
        the new block size (saying so in the log); later blocks and calls of that plan keep the smaller
        batch. Nothing is lost: completions are per input row. `on_finished(block row, completion)`: the
        decoder's row-finish hook."""
        decoder = self._decoder(prompts, params, keys, on_finished, on_step)
        try:
            executor = self._get_executor()
            executor.generate_block(prompts, decoder.max_new_tokens, decoder)
            completions = decoder.completions()
            self._count_block(executor, decoder, completions)
            return completions
        except torch.OutOfMemoryError:
            policy = self._policy
            if policy is None or policy.gpu_batch_size == 1:
                raise
        smaller = Policy.from_dict({**policy.to_dict(), "gpu_batch_size": max(1, policy.gpu_batch_size // 2)})
        log.warning("out of memory with gpu_batch_size=%d; retrying the block with %d",
                    policy.gpu_batch_size, smaller.gpu_batch_size)
        self.close()
        self._set_policy(smaller)
        self._downsized.update({old: smaller for old, new in self._downsized.items() if new == policy})
        self._downsized[policy] = smaller
        out: list[Completion] = []
        for start in range(0, len(prompts), smaller.block_size):
            part = slice(start, start + smaller.block_size)
            report = None if on_finished is None else (lambda row, c, start=start: on_finished(start + row, c))
            out += self._run_block(prompts[part], params, None if keys is None else keys[part], report, on_step)
        return out

    def _decoder(self, prompts: list[list[int]], params: SamplingParams, keys: list[int] | None,
                 on_finished: OnFinished | None, on_step: OnStep | None = None) -> BlockDecoder:
        return BlockDecoder(prompts, [params.max_new_tokens] * len(prompts), params,
                            eos_ids=self.eos_token_ids, tokenizer=self._tokenizer, keys=keys,
                            constraint=self._constraint(params, len(prompts)), on_finished=on_finished,
                            on_step=on_step)

    def _run_parallel(self, mode: str, blocks: list[list[int]], encoded: list[Encoded], params: SamplingParams,
                      keys: list[int] | None, on_finished: OnFinished | None,
                      on_step: OnStep | None = None) -> Iterator[Group]:
        """Blocks (input indices each) on several devices: "data", each block on the next free device, yielded
        as each ends; "pipeline", N blocks at a time as the N micro-batches of the pipeline, yielded in order.
        `on_finished` and `on_step` are serialized (they are called from the devices' threads)."""
        report, step = locked(on_finished), locked(on_step)
        prompts = [[encoded[i].ids for i in idx] for idx in blocks]
        decoders = [self._decoder(p, params, None if keys is None else [keys[i] for i in idx],
                                  None if report is None else (lambda row, c, idx=idx: report(idx[row], c)), step)
                    for p, idx in zip(prompts, blocks)]
        for n in run_blocks(self._get_parallel(mode), prompts, decoders):
            yield list(zip(blocks[n], decoders[n].completions()))

    def _count_block(self, executor: Any, decoder: BlockDecoder, completions: list[Completion]) -> None:
        """Add a finished block's times, tokens and the executor's peaks per tier to `stats`."""
        ex_stats = executor.stats
        report = executor.memory_report()
        self.stats.add_block(prefill_s=float(ex_stats["prefill_s"]), decode_s=float(ex_stats["decode_s"]),
                             grammar_s=decoder.grammar_s, callback_s=decoder.callback_s,
                             grammar_advance_s=decoder.advance_s, steps=int(ex_stats["steps"]),
                             prefilled_ahead=bool(ex_stats.get("prefill_ahead")),
                             tokens=sum(len(c.token_ids) for c in completions),
                             peak_bytes={tier: r.get("peak") or 0 for tier, r in report.items()})
        if self.device.type == "cuda":
            self.stats.device_peak_bytes = int(torch.cuda.max_memory_allocated(self.device))

    def _constraint(self, params: SamplingParams, rows: int) -> GrammarConstraint | None:
        if params.json_schema is None and params.choices is None and params.regex is None:
            return None
        if self._tokenizer is None:
            raise ValueError("constrained decoding (json_schema/choices/regex) needs a tokenizer; this model has none")
        n_vocab = max(self.loaded.config.vocab_size, self._tokenizer.vocab_size)
        return GrammarConstraint.for_params(params, self._tokenizer.to_json(), self.eos_token_ids, n_vocab, rows)

    # ---- policy and executor
    def _plan_for(self, workload: Workload, given: Plan | None) -> Plan:
        began = time.perf_counter()
        self._plan = self._planner.plan_for(workload, given)
        self.stats.plan_s += time.perf_counter() - began
        return self._plan

    def _set_policy(self, policy: Policy) -> None:
        if (self._executor is not None or self._parallel is not None) and not self._executor_fits(policy):
            self.close()
        self._policy = policy

    def _executor_fits(self, policy: Policy) -> bool:
        """Whether the open executor can run `policy`'s blocks: the same policy, or on the CPU (where
        placement is moot) the same flags with one GPU batch per block no larger than the executor's.
        Building an executor places every weight, so it is not rebuilt for every change of prompt count."""
        held = self._executor_policy
        if policy == held:
            return True
        shape = ("gpu_batch_size", "num_gpu_batches")
        same_rest = {k: v for k, v in policy.to_dict().items() if k not in shape} == \
            {k: v for k, v in held.to_dict().items() if k not in shape}
        return (self.device.type == "cpu" and same_rest and policy.num_gpu_batches == held.num_gpu_batches == 1
                and policy.gpu_batch_size <= held.gpu_batch_size)

    def _get_executor(self) -> Any:
        if self._executor is None:
            self._embedder = None          # one copy of the weights on the device at a time
            began = time.perf_counter()
            # looked up at call time (not imported by name), so a test can substitute the executor class
            rows = {"int4_max_rows": int4_max_rows()} if self.device.type == "cpu" else {}   # measured once
            if self.device.type == "cpu" and self._policy.cpu_dense_copy:
                rows["int4_dense_max_rows"] = int4_dense_max_rows()                               # when asked
            self._executor = executor_mod.Executor(self.loaded, self._policy, device=self.device,
                                                   dtype=self.dtype, gpu_memory=self.gpu_memory,
                                                   cpu_memory=self.cpu_memory, disk_dir=self.disk_dir, **rows)
            self._executor_policy = self._policy
            self.stats.place_s += time.perf_counter() - began
        return self._executor

    def _get_parallel(self, mode: str) -> Any:
        """The Lanes ("data") or Pipeline ("pipeline") over `devices` for the current policy."""
        kind = Lanes if mode == "data" else build_pipeline
        if self._parallel is not None and isinstance(self._parallel, Lanes) != (mode == "data"):
            self.close()
        if self._parallel is None:
            self._parallel = kind(self.loaded, self._policy, self.devices, dtype=self.dtype,
                                  gpu_memory=self.gpu_memory, cpu_memory=self.cpu_memory, disk_dir=self.disk_dir)
            self._executor_policy = self._policy
        return self._parallel

    def close(self) -> None:
        """Release the executors' buffers and files and the embedding weights. The LLM can still generate and
        embed afterwards (it rebuilds)."""
        self._embedder = None
        for held in (self._executor, self._parallel):
            if held is not None:
                held.close()
        if self._executor is not None or self._parallel is not None:
            self._executor = self._parallel = None
            for dev in {d for d in self.devices if d.type == "cuda"}:
                with torch.cuda.device(dev):
                    torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
