#!/usr/bin/env bash
# One check of the runtime on a CUDA GPU with FlashInfer (pip install .[gpu]), under 10 minutes: FlashInfer vs
# torch attention parity in bf16 (tiny Llama-3, tiny DeepSeek-V2s, a Llama-3.2-1B-shaped random model), decode
# tokens/s at batch 1, 8, 32 against transformers, and an MTP head's speculative decoding against plain decoding;
# first, CUDA graphs on and off (decode on 1B- and 8B-shaped models as a share of the bandwidth limit, kernels, host
# ms and syncs a step, and an EAGLE-3 oracle drafter at acceptance 0.8, K=2 and 4, batch 1 and 8).
# Prints one table; without CUDA it stops at once with a one-line error. On the lent GPU machine, whose image lacks
# FlashInfer, DeepSpeed and Hydra: `launch/gpu_wheels.sh` here first, then carry .whl (see that script).
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
