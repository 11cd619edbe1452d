#!/usr/bin/env bash
# One check of the runtime on a CUDA GPU with FlashInfer (pip install .[gpu]), under 10 minutes: FlashInfer vs
# torch attention parity in bf16 (tiny Llama-3, tiny DeepSeek-V2s, a Llama-3.2-1B-shaped random model), decode
# tokens/s at batch 1, 8, 32 against transformers, and an MTP head's speculative decoding against plain decoding.
# Then training: two deterministic runs bitwise, and online EAGLE-3 training against precomputed features (below).
# Prints one table; without CUDA it stops at once with a one-line error.
set -euo pipefail
cd "$(dirname "$0")/.."
ASSETS=${ASSETS:-../shared/assets}
timeout "${GPU_CHECK_TIMEOUT:-600}" "${PYTHON:-python3}" -m infer.bench.gpu_check \
    --stories "$ASSETS/stories260K/hf-reference" "$@"

# Training on the GPU: two identical short runs with trainer.deterministic=true (cuBLAS workspace, deterministic
# kernels) must give bitwise-equal heads, as fp32 runs on a CPU do. GPU_CHECK_TRAIN=0 leaves it out.
if [ "${GPU_CHECK_TRAIN:-1}" = 1 ]; then
  work=$(mktemp -d)
  common=(model.path="$ASSETS/stories260K/hf-reference" head=eagle3)
  timeout 120 "${PYTHON:-python3}" -m data_tools.precompute output_dir="$work/features" data=sharegpt_dummy \
      data.limit=64 precompute.device=cuda "${common[@]}" --no-progress >"$work/precompute.log" 2>&1
  for run in 1 2; do
    timeout 120 "${PYTHON:-python3}" -m mtp_train.train features_dir="$work/features" output_dir="$work/run$run" \
        "${common[@]}" trainer.device=cuda trainer.dtype=bfloat16 trainer.deterministic=true trainer.max_steps=30 \
        trainer.micro_batch_size=2 trainer.seq_len=256 trainer.eval_every=0 trainer.save_every=0 \
        trainer.progress=false validate.enabled=false eval_records=8 >"$work/run$run.log" 2>&1
  done
  same=no
  cmp -s "$work/run1/head/model.safetensors" "$work/run2/head/model.safetensors" && same=yes
  echo "| train | stories260K EAGLE-3 head, bf16, trainer.deterministic=true, 2 runs x 30 steps | heads bitwise equal: $same | |"
fi

# Online training on the GPU (mtp_train.gpu_train_check): an EAGLE-3 head for a Llama-3.2-1B-shaped bf16 target under
# DeepSpeed, the target computing the features in the job, against the same run on precomputed features: tokens/s,
# the step's split, the head's MFU, peak memory. GPU_CHECK_ONLINE=0 leaves it out; a failure is a row, not the end.
if [ "${GPU_CHECK_ONLINE:-1}" = 1 ]; then
  if ! timeout 300 "${PYTHON:-python3}" -m mtp_train.gpu_train_check --stories "$ASSETS/stories260K/hf-reference" \
      --steps 200 --timeout 120; then
    echo "| train | online EAGLE-3 training, Llama-3.2-1B-shaped target | failed (above) | |"
  fi
fi
