"""The facade end to end on tiny random checkpoints: parity with transformers' greedy `generate`, order,
streaming, per-prompt errors, reproducible sampling, chat templating and constrained decoding."""
from __future__ import annotations

import shutil

import pytest
import torch

from engine import LLM, Policy, SamplingParams
from engine.calibrate.cpu_dtype import fastest_cpu_dtype
from helpers.greedy_runs import id_prompts
from helpers.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer

MAX_NEW = 8


@pytest.fixture(scope="module")
def folders(tiny_checkpoints, tmp_path_factory):
    """The tiny checkpoints copied next to a tiny tokenizer (<s>=1, </s>=2 like their configs' EOS)."""
    root = tmp_path_factory.mktemp("llm")
    out = {}
    for kind in ("llama", "opt", "mixtral"):
        folder = root / kind
        shutil.copytree(tiny_checkpoints[kind], folder)
        build_tiny_tokenizer(folder)
        out[kind] = folder
    return out


def make_llm(folder, block: int = 4, batches: int = 1) -> LLM:
    return LLM(folder, dtype="float32", device="cpu", policy=Policy(gpu_batch_size=block, num_gpu_batches=batches))


def hf_greedy(folder, prompts: list[list[int]], max_new: int = MAX_NEW):
    """transformers' greedy generate, one prompt at a time (no padding): (new ids, log_softmax(scores))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        with torch.no_grad():
            res = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        new = res.sequences[0, len(prompt):].tolist()
        lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(res.scores, new)]
        out.append((new, lps))
    return out


@pytest.mark.parametrize("kind", ["llama", "opt", "mixtral"])
def test_greedy_matches_transformers(folders, kind):
    prompts = id_prompts()
    with make_llm(folders[kind]) as llm:
        got = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, logprobs=True))
    expected = hf_greedy(folders[kind], prompts)
    for i, (c, (ids, lps)) in enumerate(zip(got, expected)):
        assert c.token_ids == ids, f"prompt {i} (length {len(prompts[i])})"
        assert c.prompt_tokens == len(prompts[i])
        assert c.finish_reason == ("stop" if ids[-1] == 2 else "length")
        assert c.logprobs == pytest.approx(lps, abs=1e-4)


def test_stream_yields_every_index_once_and_errors_first(folders):
    prompts = id_prompts() + [[5] * 250]  # 250 + 8 > 256: the last prompt cannot run
    with make_llm(folders["llama"]) as llm:
        groups = list(llm.stream(prompts, SamplingParams(max_new_tokens=MAX_NEW)))
        assert llm.policy.block_size == 4
    indices = [i for g in groups for i, _ in g]
    assert sorted(indices) == list(range(len(prompts)))
    assert groups[0] == [(10, groups[0][0][1])] and groups[0][0][1].finish_reason == "error"
    assert len(groups) == 1 + 3  # the error group, then 10 prompts in blocks of 4
    lengths = [max(len(prompts[i]) for i, _ in g) for g in groups[1:]]
    assert lengths == sorted(lengths)  # blocks go by prompt length


def test_overlong_prompt_is_an_error_only_for_itself(folders):
    prompts = [[5, 6, 7], [9] * 250, [8, 9]]
    with make_llm(folders["llama"]) as llm:
        out = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
        assert llm.max_context == 256
    assert [c.finish_reason for c in out][1] == "error"
    assert "250 tokens" in out[1].error and "256" in out[1].error and out[1].text == ""
    assert all(c.error is None and len(c.token_ids) >= 1 for c in (out[0], out[2]))


def test_empty_list_and_bad_prompt_types(folders):
    with make_llm(folders["llama"]) as llm:
        assert llm.generate([]) == []
        with pytest.raises(TypeError, match=r"prompts\[1\]"):
            llm.generate(["ok", 3])
        with pytest.raises(TypeError, match=r"prompts\[0\]"):
            llm.generate([[1, "x"]])
        bad = llm.generate([[1, 999]])[0]
        assert bad.finish_reason == "error" and "999" in bad.error


def test_seeded_sampling_reproducible_across_runs_and_batch_sizes(folders):
    prompts = id_prompts() + [id_prompts()[3]]  # the last one repeats prompt 3
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.95, seed=11)
    with make_llm(folders["llama"], block=4) as small, make_llm(folders["llama"], block=3, batches=4) as large:
        first = [c.token_ids for c in small.generate(prompts, params)]
        again = [c.token_ids for c in small.generate(prompts, params)]
        other = [c.token_ids for c in large.generate(prompts, params)]
        reseeded = [c.token_ids for c in small.generate(prompts, SamplingParams(
            max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.95, seed=12))]
    assert first == again == other
    assert reseeded != first
    assert first[3] != first[10]  # identical prompts draw different samples (occurrence index)
    greedy = hf_greedy(folders["llama"], prompts[:4])
    assert [c for c, _ in greedy] != first[:4]  # temperature 1 is not greedy on a random model


def test_chat_prompts_use_the_template_like_transformers(folders):
    from transformers import PreTrainedTokenizerFast

    folder = folders["llama"]
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<s>",
                                     eos_token="</s>")
    hf_tok.chat_template = CHAT_TEMPLATE
    few_shot = [{"role": "user", "content": "order A-1"}, {"role": "assistant", "content": "A-1"},
                {"role": "user", "content": "order B-22"}]
    with make_llm(folder) as llm:
        out = llm.generate(["Invoice total", few_shot], SamplingParams(max_new_tokens=MAX_NEW, system="Be brief."))
        plain = llm.generate(["Invoice total"], SamplingParams(max_new_tokens=MAX_NEW, chat=False))[0]
    system = {"role": "system", "content": "Be brief."}  # also put before chat messages that have none
    msgs = [[system, {"role": "user", "content": "Invoice total"}], [system, *few_shot]]
    for c, m in zip(out, msgs):
        ids = hf_tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert c.prompt_tokens == len(ids)
        new, _ = hf_greedy(folder, [ids])[0]
        assert c.token_ids == new
    assert plain.prompt_tokens == len(hf_tok("Invoice total")["input_ids"])


def test_constrained_choices_on_a_random_model(folders):
    choices = ("bug", "billing", "other")
    with make_llm(folders["llama"]) as llm:
        out = llm.generate(id_prompts(6), SamplingParams(max_new_tokens=12, choices=choices, temperature=0.7))
        cut = llm.generate(id_prompts(2), SamplingParams(max_new_tokens=2, regex="[a-z]{20}"))
        with pytest.raises(ValueError, match="regex"):
            llm.generate([[1, 2]], SamplingParams(regex="(bad"))
    assert all(c.text in choices and c.finish_reason == "stop" for c in out), [c.text for c in out]
    assert all(c.finish_reason == "length" for c in cut)


def test_fingerprint_depends_on_dtype_and_compression(folders):
    a = LLM(folders["llama"], dtype="float32", device="cpu", policy=Policy(gpu_batch_size=4))
    b = LLM(folders["llama"], dtype="bfloat16", device="cpu", policy=Policy(gpu_batch_size=4))
    c = LLM(folders["llama"], dtype="float32", device="cpu", compress_weights=True, policy=Policy(gpu_batch_size=4))
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
    assert a.fingerprint == LLM(folders["llama"], dtype="float32", device="cpu").fingerprint
    assert b.dtype == torch.bfloat16
    assert LLM(folders["llama"], device="cpu").dtype == fastest_cpu_dtype()  # "auto" on a CPU: the faster GEMM
    with pytest.raises(ValueError, match="gpu_memory"):
        LLM(folders["llama"], gpu_memory="lots")


def test_out_of_memory_retries_the_block_with_smaller_batches(folders, monkeypatch):
    import engine.runtime.executor as executor_module

    real = executor_module.Executor
    seen: list[int] = []

    class Flaky(real):
        def generate_block(self, prompts, max_new_tokens, select):
            seen.append(len(prompts))
            if len(prompts) > 2:
                raise torch.OutOfMemoryError("simulated")
            return super().generate_block(prompts, max_new_tokens, select)

    prompts = id_prompts(6)
    with make_llm(folders["llama"]) as llm:
        expected = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))]
    monkeypatch.setattr(executor_module, "Executor", Flaky)
    with make_llm(folders["llama"]) as llm:
        got = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))]
        assert llm.policy.gpu_batch_size == 2
    assert got == expected
    assert seen[0] == 4 and max(seen[1:]) <= 2 and sum(n for n in seen if n <= 2) == len(prompts)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, top_p=0.95, seed=11)], ids=["greedy", "seeded"])
def test_ahead_prefill_gives_the_block_by_block_completions(folders, sampling):
    """`Policy(prefill_ahead=True)`: every block's prefill but the first runs on the previous block's decode;
    the completions (greedy, and seeded sampling) and their order are those of the block-by-block run, and the
    stats say how many blocks ran their prefill ahead."""
    prompts = id_prompts(12)
    params = SamplingParams(max_new_tokens=MAX_NEW, **sampling)
    policy = dict(gpu_batch_size=2, num_gpu_batches=2, cache_gpu=0.5, cache_cpu=0.5)
    with LLM(folders["llama"], dtype="float32", device="cpu", policy=Policy(**policy)) as plain:
        expected = [(c.token_ids, c.finish_reason) for c in plain.generate(prompts, params)]
    with LLM(folders["llama"], dtype="float32", device="cpu", policy=Policy(**policy, prefill_ahead=True)) as llm:
        got = [(c.token_ids, c.finish_reason) for c in llm.generate(prompts, params)]
        seen = sorted(i for group in llm.stream(prompts, params) for i, _ in group)
        assert llm.stats.blocks == 6 and llm.stats.prefilled_ahead == 4 and plain.stats.prefilled_ahead == 0
    assert got == expected and seen == list(range(12))


def test_ahead_prefill_with_a_shared_prefix_gives_the_block_by_block_completions(folders):
    """Every prompt starts with the same 24 tokens (a system turn): the blocks after the first still run their
    prefill ahead, the prefix computed once per GPU batch, with the block-by-block completions."""
    prefix = torch.randint(3, 320, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    prompts = [prefix + p for p in id_prompts(12, seed=3)]
    params = SamplingParams(max_new_tokens=MAX_NEW)
    policy = dict(gpu_batch_size=2, num_gpu_batches=2, cache_gpu=0.5, cache_cpu=0.5)
    with LLM(folders["llama"], dtype="float32", device="cpu", policy=Policy(**policy)) as plain:
        expected = [c.token_ids for c in plain.generate(prompts, params)]
    with LLM(folders["llama"], dtype="float32", device="cpu", policy=Policy(**policy, prefill_ahead=True)) as llm:
        got = [c.token_ids for c in llm.generate(prompts, params)]
        assert llm.stats.blocks == 3 and llm.stats.prefilled_ahead == 2
    assert got == expected


def third_block_runs_out_of_memory(monkeypatch) -> list[int]:
    """Executors made from now on raise out-of-memory in their third block (`Executor._run_block`); returns
    the rows of every block they start, in order."""
    import engine.runtime.executor as executor_module

    real = executor_module.Executor
    calls: list[int] = []

    class FailsThird(real):
        def _run_block(self, prompts, *a, **kw):
            calls.append(len(prompts))
            if len(calls) == 3:
                raise torch.OutOfMemoryError("simulated")
            return super()._run_block(prompts, *a, **kw)

    monkeypatch.setattr(executor_module, "Executor", FailsThird)
    return calls


def test_out_of_memory_with_the_ahead_prefill_loses_no_block(folders, monkeypatch):
    """An out-of-memory error in the middle of an ahead stream: the blocks already yielded stay, the rest run
    one by one (the failing one with a halved batch), and every completion is the plain run's."""
    prompts = id_prompts(12)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    with make_llm(folders["llama"], block=2, batches=2) as llm:
        expected = [c.token_ids for c in llm.generate(prompts, params)]
    calls = third_block_runs_out_of_memory(monkeypatch)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, prefill_ahead=True)
    with LLM(folders["llama"], dtype="float32", device="cpu", policy=policy) as llm:
        got = [c.token_ids for c in llm.generate(prompts, params)]
    assert got == expected and len(calls) > 3


def test_out_of_memory_after_first_token_finishes_ahead_reports_each_row_once(folders, monkeypatch):
    """Rows of the next block that end at their first token are reported while its prefill runs ahead; when
    that block then fails with out-of-memory and is rerun, `on_finished` is not called for them again."""
    prompts = id_prompts(12)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, prefill_ahead=True)
    with LLM(folders["llama"], dtype="float32", device="cpu", policy=policy) as llm:
        groups = list(llm.stream(prompts, params))
        last = [i for i, _ in groups[-1]]
        first = {i: c.token_ids[0] for group in groups for i, c in group}
        llm.eos_token_ids = (first[last[0]],)                 # a row of the third block ends at its first token
        expected = [c.token_ids for c in llm.generate(prompts, params)]
    calls = third_block_runs_out_of_memory(monkeypatch)
    reported: list[int] = []
    with LLM(folders["llama"], dtype="float32", device="cpu", policy=policy) as llm:
        llm.eos_token_ids = (first[last[0]],)
        got = sorted((i, c.token_ids) for group in llm.stream(prompts, params,
                                                                 on_finished=lambda i, c: reported.append(i))
                     for i, c in group)
    assert [t for _, t in got] == expected and len(calls) > 3
    assert any(len(t) == 1 for t in expected)
    assert sorted(reported) == list(range(12))


def test_auto_policy_reuses_the_executor_when_fewer_prompts_come(folders):
    with LLM(folders["llama"], dtype="float32", device="cpu") as llm:
        llm.generate(id_prompts(10), SamplingParams(max_new_tokens=2))
        first, batch = llm._executor, llm.policy.gpu_batch_size
        llm.generate(id_prompts(3), SamplingParams(max_new_tokens=2))
        assert llm._executor is first and llm.policy.gpu_batch_size <= batch


def test_dummy_preset_without_tokenizer_takes_token_ids():
    with LLM("tiny-llama", dtype="float32", device="cpu", policy=Policy(gpu_batch_size=4)) as llm:
        assert llm.tokenizer is None
        out = llm.generate([[3, 4, 5], [6]], SamplingParams(max_new_tokens=3))
        assert [c.text for c in out] == ["", ""] and all(1 <= len(c.token_ids) <= 3 for c in out)
        text = llm.generate(["hello"])[0]
        assert text.finish_reason == "error" and "tokenizer" in text.error
        with pytest.raises(ValueError, match="stop"):
            llm.generate([[3]], SamplingParams(stop=("x",)))
