"""The runtime: block schedule (torch-free), the one executor, KV-cache homes, attention cores, transfers.

Entry point: `engine.runtime.executor.Executor(loaded, policy, device=..., dtype=...)` and its
`generate_block(prompts, max_new_tokens, select)`; the selector contract is in `selector.py`.
"""
