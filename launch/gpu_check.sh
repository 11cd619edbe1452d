#!/usr/bin/env bash
# One check of the runtime and the trainer on a CUDA GPU with FlashInfer (pip install .[gpu]), under 10 minutes:
# first CUDA graphs on and off (decode on 1B- and 8B-shaped models as a share of the bandwidth limit, kernels, host
# ms and syncs a step, and an EAGLE-3 oracle drafter at acceptance 0.8, K=2 and 4, batch 1 and 8); FlashInfer vs
# torch attention parity in bf16 (tiny Llama-3, tiny DeepSeek-V2s, a Llama-3.2-1B-shaped random model), decode
# tokens/s at batch 1, 8, 32 against transformers, and an MTP head's speculative decoding against plain decoding;
# then training: online EAGLE-3 training against precomputed features, and two deterministic runs bitwise.
# Prints one table; without CUDA it stops at once with a one-line error. On the lent GPU machine, whose image lacks
# FlashInfer, DeepSpeed and Hydra: `launch/gpu_wheels.sh` here first, then carry .whl (see that script).
# GPU_CHECK_BUDGET_S (default 570) bounds the whole check: each stage gets at most what is left, and a stage that
# would start with too little left prints a "not run: out of time" row instead.
set -euo pipefail
cd "$(dirname "$0")/.."
ASSETS=${ASSETS:-../shared/assets}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-570}

# left CAP MIN: seconds this stage may take (at most CAP), or nothing when fewer than MIN are left
left() {
  local rest=$((BUDGET - SECONDS))
  if [ "$rest" -lt "$2" ]; then return 1; fi
  echo $((rest < $1 ? rest : $1))
}

"$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
  || { echo "error: the GPU check needs a CUDA GPU, and torch.cuda.is_available() is False here" >&2; exit 2; }

if t=$(left 420 120); then
  timeout "$t" "$PY" -m infer.bench.gpu_check --stories "$ASSETS/stories260K/hf-reference" "$@" \
    || echo "| runtime | infer.bench.gpu_check | failed or out of time (exit $?, ${t} s) | |"
fi

# Online training on the GPU (mtp_train.gpu_train_check): an EAGLE-3 head for a Llama-3.2-1B-shaped bf16 target under
# DeepSpeed, the target computing the features in the job, against the same run on precomputed features: tokens/s,
# the step's split, the head's MFU, peak memory. GPU_CHECK_ONLINE=0 leaves it out; a failure is a row, not the end.
if [ "${GPU_CHECK_ONLINE:-1}" = 1 ]; then
  if t=$(left 300 90); then
    timeout "$t" "$PY" -m mtp_train.gpu_train_check --stories "$ASSETS/stories260K/hf-reference" \
        --steps 200 --timeout $(( (t - 15) / 3 )) \
      || echo "| train | online EAGLE-3 training, Llama-3.2-1B-shaped target | failed or out of time (above) | |"
  else
    echo "| train | online EAGLE-3 training | not run: out of time | |"
  fi
fi

# Training on the GPU: two identical short runs with trainer.deterministic=true (cuBLAS workspace, deterministic
# kernels) must give bitwise-equal heads, as fp32 runs on a CPU do. GPU_CHECK_TRAIN=0 leaves it out.
if [ "${GPU_CHECK_TRAIN:-1}" = 1 ]; then
  if t=$(left 150 60); then
    work=$(mktemp -d)
    common=(model.path="$ASSETS/stories260K/hf-reference" head=eagle3)
    ok=yes
    timeout "$t" "$PY" -m data_tools.precompute output_dir="$work/features" data=sharegpt_dummy \
        data.limit=64 precompute.device=cuda "${common[@]}" --no-progress >"$work/precompute.log" 2>&1 || ok=no
    for run in 1 2; do
      [ "$ok" = yes ] && t=$(left 60 20) || { ok=no; break; }
      timeout "$t" "$PY" -m mtp_train.train features_dir="$work/features" output_dir="$work/run$run" \
          "${common[@]}" trainer.device=cuda trainer.dtype=bfloat16 trainer.deterministic=true trainer.max_steps=30 \
          trainer.micro_batch_size=2 trainer.seq_len=256 trainer.eval_every=0 trainer.save_every=0 \
          trainer.progress=false validate.enabled=false eval_records=8 >"$work/run$run.log" 2>&1 || ok=no
    done
    same=no
    [ "$ok" = yes ] && cmp -s "$work/run1/head/model.safetensors" "$work/run2/head/model.safetensors" && same=yes
    [ "$ok" = yes ] || same="not run to the end (logs: $work)"
    echo "| train | stories260K EAGLE-3 head, bf16, trainer.deterministic=true, 2 runs x 30 steps | heads bitwise equal: $same | |"
  else
    echo "| train | deterministic runs | not run: out of time | |"
  fi
fi
