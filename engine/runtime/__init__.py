"""The runtime: block schedule (torch-free), the one executor, KV-cache homes, attention cores, transfers.

Entry point: `engine.runtime.executor.Executor(loaded, policy, device=..., dtype=...)` and its
`generate_block(prompts, max_new_tokens, select)`, or `generate_blocks(blocks)` for a stream of blocks (with
`Policy.prefill_ahead`, each block's prefill runs on the previous block's decode: `ahead.py`); the selector
contract is in `selector.py`.
"""
