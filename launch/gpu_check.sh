#!/usr/bin/env bash
# One check of the runtime on a CUDA GPU with FlashInfer (pip install .[gpu]), under 10 minutes: FlashInfer vs
# torch attention parity in bf16 (tiny Llama-3, tiny DeepSeek-V2s, a Llama-3.2-1B-shaped random model), decode
# tokens/s at batch 1, 8, 32 against transformers, and an MTP head's speculative decoding against plain decoding.
# Prints one table; without CUDA it stops at once with a one-line error.
set -euo pipefail
cd "$(dirname "$0")/.."
ASSETS=${ASSETS:-../shared/assets}
timeout "${GPU_CHECK_TIMEOUT:-600}" "${PYTHON:-python3}" -m infer.bench.gpu_check \
    --stories "$ASSETS/stories260K/hf-reference" "$@"
