#!/usr/bin/env bash
# Everything the lent H200 runs in one device call: GPU tests, offloading throughput, policy validation.
# Usage (device tool, carry .whl; FlexGen 0.1.8's wheel there makes it a peer): bash benchmarks/gpu_suite.sh [tests|kernels|offload|profile|policy|all|models|moe|moe-peers|moe-pair|moe-p512|moe-hostatt|moe-2048|wrangle|wrangle-ab|flexgen-ab|flexgen-pair|multigpu|multigpu-wrangle|multigpu-one|moe-paths|moe-headline|moe-matrix-a|moe-matrix-b|moe-prefill-ab|moe-decode-ab|moe-trace|moe-extra|moe-ab]
# flexgen-pair (~4.5 min): OPT-30B ours (192x1 + ahead, --clock) and FlexGen in one call; moe-p512 (~8 min): Mixtral-8x7B
# at prompt 512 / gen 128 / 16 GiB, auto and its ablation.
# models (not in all; ~5 min): issue 18's CUDA tests (int4 checkpoints, rotated attention, DeepSeek) and the
# wrangling workload on the qwen3-30b-a3b and qwen3-32b dummies (auto from the reference profile, no trials).
# moe / moe-peers (not in all; moe ~9 min, moe-peers ~6): issue 17's MoE tests and Mixtral-8x7B runs / HF Accelerate on it;
# moe-pair (~5 min; 298 s in one H200 call): ours and Accelerate in one call (the ratio). wrangle (~7 min): Llama-3-70B's wrangle, auto and 768x2.
# flexgen-ab (~1.6 min a commit): OPT-30B under FLEXGEN_AB_POLICY from this tree and every ab/<sha>/, one LLMOPS_RUN_ID.
# wrangle-ab (~3 min a commit): Llama-3-70B's wrangle (auto) from this tree (LLMOPS_COMMIT names it) and from every
# ab/<sha>/ that benchmarks/ab_prepare.sh wrote (carry "ab"), under one LLMOPS_RUN_ID; WRANGLE_MODEL picks another preset,
# WRANGLE_LAYERS=N cuts the model;
# WRANGLE_TRACE=1 traces each run (--trace-out $OUT/timeline_wrangle-ab-<head|sha>.json.gz; trees before e2169e9 lack it).
# Several GPUs (not in all): bash benchmarks/gpu_suite.sh multigpu (GPU tests of several devices, OPT-30B pipeline and
# OPT-6.7B data-parallel on 1 and N GPUs), multigpu-wrangle (Llama-3-70B on 1 and N GPUs); N = every visible GPU (GPUS=N to pick fewer).
# multigpu-one: the same code on a machine of one GPU (two stages on cuda:0; tokens must match, no speed-up).
# policy mode: POLICY_MODELS (default opt-6.7b,opt-30b:8) and POLICY_BUDGET_S (default 400) pick its models and time.
# Results land in $OUT as <benchmark>_<workload>.json (bench_common.results_path) + logs; the lead commits them
# under benchmarks/results/h200/ (one file per benchmark and workload, replaced by a newer run: history is git's).
# Set LLMOPS_COMMIT=<sha>[-dirty] when the copied tree has no usable .git.
set -uo pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
what=${1:-all}
# issue 17's Mixtral-8x7B runs (moe-matrix-*, moe-prefill-ab): 4-bit, bf16, auto planned from the reference profile
mixtral=(--workload moe --model mixtral-8x7b --dtype bfloat16 --plan-profile reference --trials 0)
# its headline plan at 77/128/16 GiB without extra tensors (1024x2, half the weights streamed, the cache and the
# hidden states on the host), for the A/B modes
half='"w_gpu": 0.500016624511734, "w_cpu": 0.499983375, "act_gpu": 0.0, "act_cpu": 1.0, "compress_weights": true, "compress_cache": true'
p77="{\"gpu_batch_size\": 1024, \"num_gpu_batches\": 2, \"cache_gpu\": 0.0, \"cache_cpu\": 1.0, $half}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c 'import torch, platform; print(torch.__version__, torch.version.cuda, platform.python_version())' | tee -a "$OUT/machine.txt"
if [[ $what == tests || $what == all ]]; then
  { python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py tests/test_gpu_prefix.py tests/test_dummy_source.py \
      tests/test_step_clock.py tests/test_gpu_prefill_ahead.py
    python3 -m pytest -q -p no:cacheprovider tests/test_int4_runtime.py -k "cuda or gpu"
  } 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
if [[ $what == kernels || $what == all ]]; then
  { python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py tests/test_quant.py tests/test_policy_trial.py \
      tests/test_quant_fused.py tests/test_elementwise_kernels.py tests/test_quant_decode.py
    python3 benchmarks/dequant_speed.py --repeat 50              # $OUT/dequant_speed_opt-6.7b.json
    python3 benchmarks/fused_kernels_speed.py --repeat 50        # $OUT/fused_kernels_speed_llama-3-70b-prefill.json
    python3 benchmarks/cpu_attention_speed.py                    # $OUT/cpu_attention_speed_opt-30b.json
  } 2>&1 | tee "$OUT/kernels.log" | tail -30
fi
if [[ $what == offload || $what == all ]]; then
  { python3 benchmarks/throughput.py --workload flexgen --model opt-30b --gpu-memory 16GiB --out-dir "$OUT" \
      --system llmops --system flexgen --system llmops-no-pipeline \
      --policy auto --policy 4bit_w_cpu_cache_gpu_48x1 --policy 4bit_w_cpu_cache_gpu_b48
    python3 benchmarks/throughput.py --workload wrangle --model llama-3-70b --rows 1536 --gpu-memory 16GiB \
      --out-dir "$OUT" --policy auto
  } 2>&1 | tee "$OUT/throughput.log" | tail -30
fi
if [[ $what == profile || $what == all ]]; then
  # PROFILE_POLICY: a suite name or a Policy as JSON (e.g. the 48x2 split cache) to profile instead of 48x1
  python3 benchmarks/throughput.py --workload flexgen --model opt-30b --gpu-memory 16GiB --gen-len 8 --profile \
    --policy "${PROFILE_POLICY:-4bit_w_cpu_cache_gpu_48x1}" --out "$OUT/throughput_flexgen-profile.jsonl" 2>&1 \
    | tee "$OUT/throughput_profile.log" | tail -10
fi
if [[ $what == policy || $what == all ]]; then
  python3 benchmarks/policy_validation.py --out-dir "$OUT" --trials 8 --time-budget-s "${POLICY_BUDGET_S:-400}" \
    --models "${POLICY_MODELS:-opt-6.7b,opt-30b:8}" 2>&1 \
    | tee "$OUT/policy_validation.log" | tail -30
fi
if [[ $what == multigpu* ]]; then
  # NVLink multicast stays off (the machine's notes); the engine uses no NCCL, but keep them set regardless
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  N=${GPUS:-$(nvidia-smi -L | wc -l)}
fi
if [[ $what == multigpu ]]; then
  { python3 -m pytest -q -p no:cacheprovider tests/test_gpu_multi.py
    python3 benchmarks/throughput.py --workload flexgen --model opt-30b --gpu-memory 16GiB \
      --policy 4bit_w_cpu_cache_gpu_48x1 --gpus 1 --gpus "$N" --out "$OUT/throughput_flexgen-gpus.jsonl"
    python3 benchmarks/throughput.py --workload flexgen --model opt-6.7b --gpu-memory 16GiB \
      --policy 4bit_all_gpu_b96 --gpus 1 --gpus "$N" --out "$OUT/throughput_flexgen-gpus-data.jsonl"   # data-parallel
  } 2>&1 | tee "$OUT/multigpu.log" | tail -30
fi
if [[ $what == multigpu-wrangle ]]; then
  python3 benchmarks/throughput.py --workload wrangle --model llama-3-70b --gpu-memory 16GiB --rows $((768 * N)) \
    --policy '{"gpu_batch_size": 192, "num_gpu_batches": 4, "w_gpu": 0.0, "w_cpu": 1.0, "cache_gpu": 0.0, "cache_cpu": 1.0, "act_gpu": 0.0, "act_cpu": 1.0, "compress_weights": true, "compress_cache": true}' \
    --gpus 1 --gpus "$N" --out "$OUT/throughput_wrangle-gpus.jsonl" 2>&1 | tee "$OUT/multigpu_wrangle.log" | tail -30
fi
if [[ $what == multigpu-one ]]; then
  { python3 -m pytest -q -p no:cacheprovider tests/test_gpu_multi.py
    python3 benchmarks/throughput.py --workload flexgen --model opt-30b --gpu-memory 16GiB --gen-len 8 \
      --policy 4bit_w_cpu_cache_gpu_48x1 --gpus 1 --gpus 2 --one-device --out "$OUT/throughput_flexgen-one-gpu-stages.jsonl"
  } 2>&1 | tee "$OUT/multigpu_one.log" | tail -30
fi
if [[ $what == models ]]; then
  { python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_int4_runtime.py tests/test_quant_kernels.py \
      tests/test_rotated_attention.py tests/test_deepseek_parity.py
    for model in qwen3-30b-a3b qwen3-32b; do
      python3 benchmarks/throughput.py --workload wrangle --model "$model" --gpu-memory 16GiB \
        --plan-profile reference --trials 0 --policy auto --out "$OUT/throughput_wrangle-$model.jsonl"
    done
  } 2>&1 | tee "$OUT/models.log" | tail -40
fi
if [[ $what == moe ]]; then
  { python3 -m pytest -q -p no:cacheprovider tests/test_moe_pipeline.py tests/test_moe_schedule.py tests/test_moe_experts.py
    python3 benchmarks/cpu_attention_speed.py --shape mixtral-8x7b        # $OUT/cpu_attention_speed_mixtral-8x7b.json
    # auto from the reference profile, no trials (bounded time; MOE_PLAN="--plan-profile measured --trials 4"
    # plans as LLM(policy="auto") does, +1-4 min); the ablation runs the same policy with pipeline off
    python3 benchmarks/throughput.py --workload moe --model mixtral-8x7b --gpu-memory 16GiB --out-dir "$OUT" \
      ${MOE_PLAN:---plan-profile reference --trials 0} --policy auto --system llmops --system llmops-no-pipeline
    # 1,024 rows: the batch that amortizes the weights (stop 26: auto 1024x1, 1,816.6 tok/s; 512 rows: 1,001)
    python3 benchmarks/throughput.py --workload moe --model mixtral-8x7b --gpu-memory 16GiB --out-dir "$OUT" \
      ${MOE_PLAN:---plan-profile reference --trials 0} --policy auto --rows 1024
  } 2>&1 | tee "$OUT/moe.log" | tail -40
fi
if [[ $what == wrangle ]]; then
  # issue 16's 200k rows/h target (stop 27: auto 1536x1, 188,538 rows/h) and the plan auto passed over, in one call
  for policy in auto '{"gpu_batch_size": 768, "num_gpu_batches": 2, "w_gpu": 0.2779, "w_cpu": 0.7221, "cache_gpu": 0.0, "cache_cpu": 1.0, "compress_weights": true, "compress_cache": true}'; do
    python3 benchmarks/throughput.py --workload wrangle --model llama-3-70b --gpu-memory 16GiB \
      --plan-profile reference --trials 0 --policy "$policy" --out "$OUT/throughput_wrangle-llama-3-70b.jsonl"
  done 2>&1 | tee "$OUT/wrangle.log" | tail -10
fi
if [[ $what == wrangle-ab ]]; then
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-ab-$(date -u +%Y%m%dT%H%M%SZ)}
  args=(--workload wrangle --model "${WRANGLE_MODEL:-llama-3-70b}" --gpu-memory 16GiB --plan-profile reference --trials 0
        --policy auto)
  [[ -n ${WRANGLE_LAYERS:-} ]] && args+=(--layers "$WRANGLE_LAYERS")
  trace() { [[ -n ${WRANGLE_TRACE:-} ]] && echo --trace --trace-out "$OUT/timeline_wrangle-ab-$1.json.gz"; }
  { python3 benchmarks/throughput.py "${args[@]}" $(trace head) --out "$OUT/throughput_wrangle-ab-head.jsonl"
    for tree in ab/*/; do
      sha=$(basename "$tree")
      (cd "$tree" && PYTHONPATH=$PWD LLMOPS_COMMIT=$sha python3 benchmarks/throughput.py "${args[@]}" $(trace "$sha") \
        --out "$OUT/throughput_wrangle-ab-$sha.jsonl")
    done
  } 2>&1 | grep -v "block 1/" | tee "$OUT/wrangle_ab.log" | tail -20
fi
if [[ $what == flexgen-ab ]]; then
  # OPT-30B under one policy (FLEXGEN_AB_POLICY, default 96x1 with half the cache heads on the host: a decode
  # that loads the cache off the device at every attention layer) from this tree and every ab/<sha>/, one run id
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-flexgen-ab-$(date -u +%Y%m%dT%H%M%SZ)}
  policy=${FLEXGEN_AB_POLICY:-'{"gpu_batch_size": 96, "num_gpu_batches": 1, "w_gpu": 0.0, "w_cpu": 1.0, "cache_gpu": 0.5, "cache_cpu": 0.5, "compress_weights": true, "compress_cache": true}'}
  args=(--workload flexgen --model opt-30b --gpu-memory 16GiB --policy "$policy")
  { python3 benchmarks/throughput.py "${args[@]}" --out "$OUT/throughput_flexgen-ab-head.jsonl"
    for tree in ab/*/; do
      sha=$(basename "$tree")
      (cd "$tree" && PYTHONPATH=$PWD LLMOPS_COMMIT=$sha python3 benchmarks/throughput.py "${args[@]}" \
        --out "$OUT/throughput_flexgen-ab-$sha.jsonl")
    done
  } 2>&1 | grep -v "block 1/" | tee "$OUT/flexgen_ab.log" | tail -20
fi
if [[ $what == moe-pair ]]; then
  # issue 17's Accelerate ratio in one call: ours (1,024 rows, auto; ~2.3 min in stop 28) first, then Accelerate on
  # 256 rows x MOE_PEER_GEN (4) new tokens (~1.7 min: build 22 s, place 2 s, warm-up 16 s, 4 steps of 12-16 s);
  # its record carries prefill_s, decode_step_s and projected_tokens_per_s_at_workload_gen (gen 128); one run id
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-moe-pair-$(date -u +%Y%m%dT%H%M%SZ)}
  { python3 benchmarks/throughput.py --workload moe --model mixtral-8x7b --gpu-memory 16GiB --rows 1024 \
      --plan-profile reference --trials 0 --policy auto --out "$OUT/throughput_moe-accelerate.jsonl"
    python3 benchmarks/throughput.py --workload moe --model mixtral-8x7b --gpu-memory 16GiB --system accelerate \
      --peer-rows 256 --peer-gen-len "${MOE_PEER_GEN:-4}" --out "$OUT/throughput_moe-accelerate.jsonl"
  } 2>&1 | tee "$OUT/moe_pair.log" | tail -10
fi
if [[ $what == flexgen-pair ]]; then
  # issue 16's ratio in one call (stop 39 call 3, ~4.5 min): ours 192x1 + ahead with the step clock over
  # FLEXGEN_ROWS (576 = 3 blocks) rows, then FlexGen 0.1.8's best-measured policy; one run id
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-flexgen-pair-$(date -u +%Y%m%dT%H%M%SZ)}
  pol='{"gpu_batch_size":192,"num_gpu_batches":1,"w_gpu":0.0,"w_cpu":1.0,"cache_gpu":0.161,"cache_cpu":0.839,"compress_weights":true,"compress_cache":true,"prefill_ahead":true}'
  { python3 benchmarks/throughput.py --workload flexgen --model opt-30b --gpu-memory 16GiB --cpu-memory 110GiB \
      --num-prompts "${FLEXGEN_ROWS:-576}" --policy "$pol" --clock --system llmops --out "$OUT/throughput_flexgen.jsonl"
    python3 benchmarks/throughput.py --workload flexgen --model opt-30b --gpu-memory 16GiB --system flexgen \
      --out "$OUT/throughput_flexgen.jsonl"
  } 2>&1 | grep -v '^{' | tee "$OUT/flexgen_pair.log" | tail -12
fi
if [[ $what == moe-p512 ]]; then
  # issue 17's missing cell (prompt 512, gen 128, 16 GiB; ~7-8 min): auto from the reference profile and its ablation
  python3 benchmarks/throughput.py --workload moe --model mixtral-8x7b --prompt-len 512 --gen-len 128 \
    --gpu-memory 16GiB --rows 512 --plan-profile reference --trials 0 --policy auto --system llmops \
    --system llmops-no-pipeline --clock --out "$OUT/throughput_moe.jsonl" 2>&1 | grep -v '^{' \
    | tee "$OUT/moe_p512.log" | tail -12
fi
if [[ $what == moe-hostatt ]]; then
  # issue 17's CGOPipe policies (~8 min): bf16 as LLM's dtype="auto" on CUDA, 4-bit weights, a 16-bit host cache
  # read by host attention, 1,024 rows: the search's host-attention pick (512x2, one weight page per GPU batch since
  # stop 40 priced pages) with its ablation, then stop 40 call 1's 256x4 with 4 pages instead of 27; one run id
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-moe-hostatt-$(date -u +%Y%m%dT%H%M%SZ)}
  args=(--workload moe --model mixtral-8x7b --gpu-memory 16GiB --dtype bfloat16 --rows 1024 --clock
        --out "$OUT/throughput_moe.jsonl")
  host='"act_gpu": 0.0, "act_cpu": 1.0, "cpu_attention": true, "compress_weights": true, "compress_cache": false'
  pol2='{"gpu_batch_size": 512, "num_gpu_batches": 2, "w_gpu": 0.0, "w_cpu": 1.0, "cache_gpu": 0.375, "cache_cpu": 0.625, '$host', "weight_pages": 2}'
  pol4='{"gpu_batch_size": 256, "num_gpu_batches": 4, "w_gpu": 0.5, "w_cpu": 0.5, "cache_gpu": 0.0, "cache_cpu": 1.0, '$host', "weight_pages": 4}'
  { timeout "${MOE_T1:-330}" python3 benchmarks/throughput.py "${args[@]}" --policy "$pol2" \
      --system llmops --system llmops-no-pipeline
    timeout "${MOE_T2:-200}" python3 benchmarks/throughput.py "${args[@]}" --policy "$pol4"
  } 2>&1 | grep -v '^{' | tee "$OUT/moe_hostatt.log" | tail -14
fi
if [[ $what == moe-2048 ]]; then
  # issue 17's main shape on a 2,048-row block (~5 min; stop 41: ours 1.9 min, the ablation 2.7): the ablation
  # first, then auto (4-bit weights and cache; the search's pick, 1024x2 with the cache streamed to GPU attention),
  # with the step clock, in one call. MOE_ROWS=4096: auto picks 4096x1, every weight streamed (~8 min)
  rows=${MOE_ROWS:-2048}
  python3 benchmarks/throughput.py --workload moe --model mixtral-8x7b --gpu-memory 16GiB --dtype bfloat16 \
    --rows "$rows" --plan-profile reference --trials 0 --policy auto --system llmops-no-pipeline --system llmops \
    --clock --out "$OUT/throughput_moe.jsonl" 2>&1 | grep -v '^{' | tee "$OUT/moe_$rows.log" | tail -8
fi
if [[ $what == moe-matrix-a || $what == moe-matrix-b || $what == moe-headline ]]; then
  # issue 17's whole matrix (Mixtral-8x7B, 4-bit, bf16, auto from the reference profile) in two calls of one
  # lease, one LLMOPS_RUN_ID: part a (~10 min) the headline shape (prompt 77, gen 128, 16 GiB, 2,048 rows) with
  # its ablation, then Accelerate on prompt 77 (256 rows x MOE_PEER_GEN new tokens, projected to gen 128) and
  # prompt 77 / gen 32 at 16 and 24 GiB; part b (~9.5 min) prompt 77 / gen 128 / 24 GiB and prompt 512 (512
  # rows) at gen 32 and 128, 16 and 24 GiB. Each configuration has its own timeout (stop 45: 290 s cut ours on the headline shape, no record)
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-moe-matrix-$(date -u +%Y%m%dT%H%M%SZ)}
  cell() {  # cell SECONDS PROMPT GEN GIB ROWS [more throughput.py args]
    local t=$1 p=$2 g=$3 m=$4 r=$5; shift 5
    timeout "$t" python3 benchmarks/throughput.py "${mixtral[@]}" --prompt-len "$p" --gen-len "$g" \
      --gpu-memory "${m}GiB" --rows "$r" --policy auto --clock --out "$OUT/throughput_moe.jsonl" "$@"
  }
  { if [[ $what != moe-matrix-b ]]; then         # moe-headline: this pair alone (~5 min)
      cell 345 77 128 16 2048 --system llmops-no-pipeline --system llmops
    fi
    if [[ $what == moe-matrix-a ]]; then
      timeout 100 python3 benchmarks/throughput.py --workload moe --model mixtral-8x7b --gpu-memory 16GiB \
        --system accelerate --peer-rows 256 --peer-gen-len "${MOE_PEER_GEN:-3}" --out "$OUT/throughput_moe.jsonl"
      cell 80 77 32 16 2048 --system llmops
      cell 80 77 32 24 2048 --system llmops
    elif [[ $what == moe-matrix-b ]]; then
      cell 125 77 128 24 2048 --system llmops
      cell 75 512 32 16 512 --system llmops
      cell 75 512 32 24 512 --system llmops
      cell 145 512 128 16 512 --system llmops
      cell 145 512 128 24 512 --system llmops
    fi
  } 2>&1 | grep -v '^{' | tee "$OUT/$what.log" | tail -30
fi
if [[ $what == moe-extra ]]; then
  # the headline pair (ours and the ablation, auto: 1024x2 with w_gpu_extra tensors) and ours under the same plan
  # without the extra tensors, in one call (~6 min); then the link's rate for weights and a 4-bit KV home's
  # pitched parts (benchmarks/link_speed.py) and the CUDA tests of the extra tensors
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-moe-extra-$(date -u +%Y%m%dT%H%M%SZ)}
  run77() { timeout "$1" python3 benchmarks/throughput.py "${mixtral[@]}" --prompt-len 77 --gen-len 128 --gpu-memory 16GiB \
      --rows 2048 --clock --out "$OUT/throughput_moe.jsonl" "${@:2}"; }
  { run77 345 --policy auto --system llmops-no-pipeline --system llmops
    run77 130 --policy "$p77" --system llmops
    timeout 60 python3 benchmarks/link_speed.py --out "$OUT/link_speed_kv-home.json"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py tests/test_policy_trial.py -k "w_disk_extra or on_cuda"
  } 2>&1 | grep -v '^{' | tee "$OUT/moe-extra.log" | tail -40
fi
if [[ $what == moe-ab ]]; then
  # the headline from this tree against every ab/<sha>/ (benchmarks/ab_prepare.sh SHA; carry "ab"; ~8 min with one ab
  # tree): the CUDA tests MOE_AB_TESTS names (pytest arguments; default the CUDA tests of the MoE pipeline, the step
  # clock, the runtime, the ahead prefill and the trials), then the headline (77/128/16 GiB, 2,048 rows, auto) from
  # each tree and this tree's ablation, one run id: a change's gain and the ratio to the ablation in one call
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-moe-ab-$(date -u +%Y%m%dT%H%M%SZ)}
  read -r -a tests <<< "${MOE_AB_TESTS:-tests/test_moe_pipeline.py tests/test_step_clock.py tests/test_gpu_runtime.py \
    tests/test_gpu_prefill_ahead.py tests/test_policy_trial.py -k cuda}"
  { timeout 170 python3 -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tail -3
    for tree in ab/*/ ./; do
      sha=$(basename "$tree"); [[ $tree == ./ ]] && sha=${LLMOPS_COMMIT:-head}
      (cd "$tree" && export PYTHONPATH=$PWD:${PYTHONPATH#*:} LLMOPS_COMMIT=$sha
       timeout 130 python3 benchmarks/throughput.py "${mixtral[@]}" --prompt-len 77 --gen-len 128 --gpu-memory 16GiB \
         --rows 2048 --clock --policy auto --system llmops --out "$OUT/throughput_moe.jsonl")
    done
    timeout 170 python3 benchmarks/throughput.py "${mixtral[@]}" --prompt-len 77 --gen-len 128 --gpu-memory 16GiB \
      --rows 2048 --clock --policy auto --system llmops-no-pipeline --out "$OUT/throughput_moe.jsonl"
  } 2>&1 | grep -v '^{' | tee "$OUT/moe-ab.log" | tail -40
fi
if [[ $what == moe-prefill-ab ]]; then
  # the MoE prefill from this tree against every ab/<sha>/ (benchmarks/ab_prepare.sh; carry "ab"), one run id
  # (~2.5 min a tree): Mixtral-8x7B cut to 4 layers under MOE_AB_POLICY (default: the prompt-512 / gen-32 /
  # 16 GiB plan, 256x2, weights streamed, the cache on the device, hidden states on the host) over 512 rows of
  # prompt 512 x 4 new tokens, then the whole model (auto from the reference profile) at prompt 512 / gen 32 /
  # 16 GiB over 512 rows and prompt 77 / gen 32 / 16 GiB over 2,048; then this tree's 4-layer run traced
  # (timeline_moe-4L-ab-<commit>.json.gz, read by benchmarks/timeline.py)
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-moe-prefill-ab-$(date -u +%Y%m%dT%H%M%SZ)}
  pol=${MOE_AB_POLICY:-'{"gpu_batch_size": 256, "num_gpu_batches": 2, "w_gpu": 0.0, "w_cpu": 1.0, "cache_gpu": 1.0, "cache_cpu": 0.0, "act_gpu": 0.0, "act_cpu": 1.0, "compress_weights": true, "compress_cache": true}'}
  moe=("${mixtral[@]}" --gpu-memory 16GiB --system llmops --out "$OUT/throughput_moe-prefill-ab.jsonl")
  four=(--layers 4 --rows 512 --prompt-len 512 --gen-len 4 --policy "$pol")
  { for tree in ab/*/ ./; do
      sha=$(basename "$tree"); [[ $tree == ./ ]] && sha=${LLMOPS_COMMIT:-head}
      (cd "$tree" && export PYTHONPATH=$PWD:${PYTHONPATH#*:} LLMOPS_COMMIT=$sha
       timeout 100 python3 benchmarks/throughput.py "${moe[@]}" "${four[@]}"
       timeout 120 python3 benchmarks/throughput.py "${moe[@]}" --rows 512 --prompt-len 512 --gen-len 32 --policy auto
       timeout 120 python3 benchmarks/throughput.py "${moe[@]}" --rows 2048 --prompt-len 77 --gen-len 32 --policy auto)
    done
    timeout 100 python3 benchmarks/throughput.py "${mixtral[@]}" --gpu-memory 16GiB "${four[@]}" --clock --trace \
      --trace-out "$OUT/timeline_moe-4L-ab-${LLMOPS_COMMIT:-head}.json.gz" --out "$OUT/throughput_moe-4L-trace.jsonl"
  } 2>&1 | grep -v '^{' | tee "$OUT/moe-prefill-ab.log" | tail -30
fi
if [[ $what == moe-decode-ab ]]; then
  # the MoE decode from this tree against every ab/<sha>/ (benchmarks/ab_prepare.sh; carry "ab"), one run id
  # (~1 min a tree, after the CUDA tests of the MoE schedule): Mixtral-8x7B cut to 4 layers, 16 new tokens, under
  # the 512/128/24 GiB plan (256x2, half the weights streamed, 5/8 of the cache on the device; 512 rows of 512)
  # and the 77/128/16 GiB headline's (1024x2, half the weights streamed, the cache on the host; 2,048 rows of 77):
  # the decode steps of 1aa1d95 (compressed experts loaded a layer ahead) against d92d614's
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-moe-decode-ab-$(date -u +%Y%m%dT%H%M%SZ)}
  p24="{\"gpu_batch_size\": 256, \"num_gpu_batches\": 2, \"cache_gpu\": 0.625, \"cache_cpu\": 0.375, $half}"
  moe=("${mixtral[@]}" --layers 4 --gen-len 16 --clock --system llmops --out "$OUT/throughput_moe-decode-ab.jsonl")
  { python3 -m pytest -q -p no:cacheprovider tests/test_moe_pipeline.py tests/test_moe_schedule.py tests/test_held_weights.py \
      tests/test_act_homes.py 2>&1 | tail -3
    for tree in ab/*/ ./; do
      sha=$(basename "$tree"); [[ $tree == ./ ]] && sha=${LLMOPS_COMMIT:-head}
      (cd "$tree" && export PYTHONPATH=$PWD:${PYTHONPATH#*:} LLMOPS_COMMIT=$sha
       timeout 60 python3 benchmarks/throughput.py "${moe[@]}" --gpu-memory 24GiB --rows 512 --prompt-len 512 --policy "$p24"
       timeout 60 python3 benchmarks/throughput.py "${moe[@]}" --gpu-memory 16GiB --rows 2048 --prompt-len 77 --policy "$p77")
    done
  } 2>&1 | grep -v '^{' | tee "$OUT/moe-decode-ab.log" | tail -30
fi
if [[ $what == moe-trace ]]; then
  # where the MoE prefill's time goes past its compute floor (~4 min; stop 49 at 42ad1e3: the prompt-77 prefills
  # at ~0.66 of it, the prompt-512 ones at 0.57-0.61, and 512/32/16 GiB missed the roofline target on its prefill,
  # 16.8 s against a 9.6 s floor): Mixtral-8x7B cut to 4 layers, traced (timeline_moe-4L-<plan>-<commit>.json.gz,
  # read by benchmarks/timeline.py): 2,048 rows of prompt 77 x 4 new tokens under the 77/32/24 GiB plan's shape
  # (2048x1, hidden states on the device) and the 16 GiB headline's (1024x2, hidden states on the host); then
  # 512 rows of prompt 512 under the 512/32/16 GiB plan (256x2, weights streamed, the cache on the device, hidden
  # states on the host), at the default 4,096-token prefill chunks and at 16,384 (stop 49: 1.168 -> 1.046 s at
  # prompt 77 under 1024x2, but the memory model then plans worse); one run id
  export LLMOPS_RUN_ID=${LLMOPS_RUN_ID:-moe-trace-$(date -u +%Y%m%dT%H%M%SZ)}
  on='"act_gpu": 1.0, "act_cpu": 0.0, "cache_gpu": 1.0, "cache_cpu": 0.0'
  off='"act_gpu": 0.0, "act_cpu": 1.0, "cache_gpu": 0.0, "cache_cpu": 1.0'
  w='"w_gpu": 0.5, "w_cpu": 0.5, "compress_weights": true, "compress_cache": true'
  p512='{"gpu_batch_size": 256, "num_gpu_batches": 2, "w_gpu": 0.0, "w_cpu": 1.0, "cache_gpu": 1.0, "cache_cpu": 0.0, "act_gpu": 0.0, "act_cpu": 1.0, "compress_weights": true, "compress_cache": true}'
  trace() {  # trace NAME ROWS PROMPT GIB POLICY [more throughput.py args]
    local name=$1 rows=$2 prompt=$3 gib=$4 pol=$5; shift 5
    timeout 120 python3 benchmarks/throughput.py "${mixtral[@]}" --gpu-memory "${gib}GiB" --layers 4 --rows "$rows" \
      --prompt-len "$prompt" --gen-len 4 --policy "$pol" --clock --trace "$@" \
      --trace-out "$OUT/timeline_moe-4L-$name-${LLMOPS_COMMIT:-head}.json.gz" --out "$OUT/throughput_moe-4L-trace.jsonl"
  }
  { trace 2048x1 2048 77 24 "{\"gpu_batch_size\": 2048, \"num_gpu_batches\": 1, $w, $on}"
    trace 1024x2 2048 77 24 "{\"gpu_batch_size\": 1024, \"num_gpu_batches\": 2, $w, $off}"
    trace p512-256x2 512 512 16 "$p512"
    trace p512-256x2-16k 512 512 16 "$p512" --prefill-chunk-tokens 16384
  } 2>&1 | grep -v '^{' | tee "$OUT/moe-trace.log" | tail -20
fi
if [[ $what == moe-paths ]]; then
  # issue 17 on the product paths (carry .whl with pydantic, duckdb, llguidance >= 1.9 and
  # .bench_assets/smollm2_tokenizer): a random AWQ int4 Mixtral-8x7B (MOE_LAYERS=4 cuts it; stop 41 ran 4 layers
  # in 94 s), then MOE_PATHS (default the engine and `llmops run`; job_paths.py's names) over MOE_ROWS (2048)
  # invoice rows, auto unless MOE_POLICY (a Policy as JSON) fixes the plan, and the engine path again at the end
  # (stop 55: each path decoded slower than the one before; the second engine run shows such drift); ~7-9 min
  layers=()
  [[ -n ${MOE_LAYERS:-} ]] && layers=(--layers "$MOE_LAYERS")
  policy=()
  [[ -n ${MOE_POLICY:-} ]] && policy=(--policy "$MOE_POLICY")
  { python3 benchmarks/build_bench_model.py --out /tmp/mixtral_awq --tokenizer .bench_assets/smollm2_tokenizer \
      --shape mixtral-8x7b "${layers[@]}" | tail -n 4
    python3 benchmarks/job_paths.py --model /tmp/mixtral_awq --gpu-memory 16GiB --rows "${MOE_ROWS:-2048}" \
      --paths "${MOE_PATHS:-engine,pipeline}" "${policy[@]}" --engine-again --out "$OUT/job_paths_moe.jsonl" | grep -v '^{'
  } 2>&1 | tee "$OUT/moe_paths.log" | tail -20
fi
if [[ $what == moe-peers ]]; then
  # Accelerate streams 93 GB of fp16 from pageable RAM: ~16 s per step at batch 256 (ENVIRONMENT.md), so a few steps
  python3 benchmarks/throughput.py --workload moe --model mixtral-8x7b --gpu-memory 16GiB --system accelerate \
    --peer-rows 256 --peer-gen-len "${MOE_PEER_GEN:-4}" --out "$OUT/throughput_moe-accelerate.jsonl" 2>&1 \
    | tee "$OUT/moe_peers.log" | tail -10
fi
