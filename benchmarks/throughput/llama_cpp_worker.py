"""llama.cpp's side of `cpu_peers.py`, run in its own process (the built `llama_cpp` package on its path).

Reads one JSON request on stdin and writes one JSON answer on stdout. Requests:
  {"op": "quantize", "src": gguf, "dst": gguf, "ftype": "Q4_0" | "Q8_0" | "BF16" | "F16", "threads": n}
  {"op": "generate", "gguf": path, "threads": n, "batch": b, "prompts": [[token ids]], "max_new_tokens": m,
   "eos": [ids]}
`generate` runs the prompts in order, `batch` sequences at a time, through llama.cpp's C API (the package's
ctypes bindings; its high-level `Llama` runs one sequence): each group's prompts go in as one batch of tokens
(logits of each row's last token only), then one token per live row per step, greedy (argmax of the logits),
a row ending at an end-of-generation id or after m tokens; the KV cache is cleared between groups. It
answers {"tokens": generated ids per row, "prefill_s", "decode_s", "prompt_tokens", "generated_tokens",
"load_s", "llama_cpp": version, "system_info": llama.cpp's CPU feature string}.
"""
from __future__ import annotations

import ctypes
import json
import sys
import time

import numpy as np

import llama_cpp.llama_cpp as C  # the built package: this process's path holds it (cpu_peers.py sets it)

FTYPES = {"F16": C.LLAMA_FTYPE_MOSTLY_F16, "Q4_0": C.LLAMA_FTYPE_MOSTLY_Q4_0, "Q4_1": C.LLAMA_FTYPE_MOSTLY_Q4_1,
          "Q8_0": C.LLAMA_FTYPE_MOSTLY_Q8_0, "BF16": C.LLAMA_FTYPE_MOSTLY_BF16}


_QUIET = C.llama_log_callback(lambda level, text, data: None)    # llama.cpp's log, dropped (kept alive here)


def quantize(src: str, dst: str, ftype: str, threads: int) -> dict:
    """The GGUF `src` re-quantized to `ftype` (from its stored values: llama.cpp's `allow_requantize`)."""
    params = C.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    params.allow_requantize = True
    rc = C.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) returned {rc}")
    return {"dst": dst}


class Session:
    """One model and one context sized for `batch` sequences of up to `ctx_per_seq` tokens each."""

    def __init__(self, gguf: str, threads: int, batch: int, ctx_per_seq: int, n_batch: int) -> None:
        began = time.perf_counter()
        mparams = C.llama_model_default_params()
        self.model = C.llama_model_load_from_file(gguf.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = C.llama_context_default_params()
        cparams.n_ctx = batch * ctx_per_seq
        cparams.n_batch = n_batch                   # a group's whole prompt in one llama_decode call
        cparams.n_ubatch = min(n_batch, 512)        # llama.cpp's default micro-batch
        cparams.n_seq_max = batch
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = False                  # a cache stream per sequence: attention over its own cells
        self.ctx = C.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = C.llama_model_get_vocab(self.model)
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        self.n_batch = n_batch
        self.batch = C.llama_batch_init(n_batch, 0, 1)
        self.load_s = time.perf_counter() - began

    def close(self) -> None:
        C.llama_batch_free(self.batch)
        C.llama_free(self.ctx)
        C.llama_model_free(self.model)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of items (token, position, sequence, wants logits), at most n_batch -> the
        batch index of every item that wants logits, in order (`llama_get_logits_ith` takes it)."""
        if len(items) > self.n_batch:
            raise ValueError(f"{len(items)} tokens exceed the context's n_batch {self.n_batch}")
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = tok, pos, 1, seq, logits
        b.n_tokens = len(items)
        rc = C.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return [i for i, item in enumerate(items) if item[3]]

    def _argmax(self, i: int) -> int:
        row = np.ctypeslib.as_array(C.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return int(row.argmax())

    def group(self, prompts: list[list[int]], max_new: int, eos: set[int]) -> tuple[list[list[int]], float, float]:
        """Greedy generation for one group of rows -> (tokens per row, prefill seconds, decode seconds)."""
        C.llama_memory_clear(C.llama_get_memory(self.ctx), True)
        began = time.perf_counter()
        items = [(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
        outs = self._decode(items)                  # one call: n_batch holds the group's prompt tokens
        tokens = [[self._argmax(i)] for i in outs]
        prefill_s = time.perf_counter() - began
        live = [r for r in range(len(prompts)) if tokens[r][-1] not in eos and max_new > 1]
        while live:
            outs = self._decode([(tokens[r][-1], len(prompts[r]) + len(tokens[r]) - 1, r, True) for r in live])
            for r, i in zip(live, outs):
                tokens[r].append(self._argmax(i))
            live = [r for r in live if tokens[r][-1] not in eos and len(tokens[r]) < max_new]
        return tokens, prefill_s, time.perf_counter() - began - prefill_s


def generate(req: dict) -> dict:
    prompts, batch, max_new = req["prompts"], int(req["batch"]), int(req["max_new_tokens"])
    longest = max(map(len, prompts))
    n_batch = max(512, min(len(prompts), batch) * longest)      # a group's prompt tokens, at most
    session = Session(req["gguf"], int(req["threads"]), batch, longest + max_new + 1, n_batch)
    eos = set(req["eos"]) | {t for t in range(session.n_vocab) if C.llama_vocab_is_eog(session.vocab, t)}
    try:
        session.group([prompts[0]], 2, eos)    # warm-up: threads, buffers
        tokens, prefill_s, decode_s = [], 0.0, 0.0
        for s in range(0, len(prompts), batch):
            out, p, d = session.group(prompts[s:s + batch], max_new, eos)
            tokens += out
            prefill_s += p
            decode_s += d
    finally:
        session.close()
    return {"tokens": tokens, "prefill_s": prefill_s, "decode_s": decode_s, "load_s": session.load_s,
            "prompt_tokens": sum(map(len, prompts)), "generated_tokens": sum(map(len, tokens)),
            "llama_cpp": _package_version(),
            "system_info": C.llama_print_system_info().decode(errors="replace")}


def _package_version() -> str | None:
    import llama_cpp  # the package itself (imported above through its ctypes module)

    return getattr(llama_cpp, "__version__", None)


def main() -> None:
    req = json.loads(sys.stdin.read())
    C.llama_backend_init()
    C.llama_log_set(_QUIET, ctypes.c_void_p())
    if req["op"] == "quantize":
        out = quantize(req["src"], req["dst"], req["ftype"], int(req["threads"]))
    elif req["op"] == "generate":
        out = generate(req)
    else:
        raise ValueError(f"unknown op {req['op']!r}")
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
