#!/usr/bin/env bash
# The whole pipeline on the embedded default, stories260K, in one command:
#   1. convert the llama2.c checkpoint to a Hugging Face folder (first use only);
#   2. self-distil: the target writes stories from BOS through infer/ (T=1, seeded);
#   3. precompute the target's features through infer/ (sharded safetensors + manifest);
#   4. train a head with DeepSpeed under torchrun (2 processes on CPU, gloo);
#   5. validate it in infer/ (speculative decoding: acceptance per position, tau, speedup);
#   6. export it to the runtime, SGLang NextN and EAGLE layouts.
# HEADS="mtp eagle1" trains the EAGLE-1 ablation on the same data too, for the norm comparison.
#
#   launch/pipeline.sh                       # defaults below; every variable can be overridden
#   STEPS=400 STORIES=1500 launch/pipeline.sh   # a quicker run (about 3 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."

ASSETS=${ASSETS:-../shared/assets}
OUT=${OUT:-artifacts}
MODEL=$OUT/stories260K
STORIES=${STORIES:-3000}       # self-distilled stories (from BOS, T=1)
STEPS=${STEPS:-1500}           # optimizer steps per head
HEADS=${HEADS:-mtp}            # heads to train on the same features: mtp and/or eagle1
NPROC=${NPROC:-2}              # torchrun processes
K=${K:-4}                      # draft tokens per step when validating
THREADS=${THREADS:-1}          # torch threads per process: tiny models run best on one
export OMP_NUM_THREADS=$THREADS
if ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=cpu; fi
start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - start ))s] $*"; }

if [ ! -f "$MODEL/config.json" ]; then
  stamp "convert stories260K"
  python -m data_tools.convert_llama2c --checkpoint "$ASSETS/stories260K/llama2c/stories260K.bin" \
    --tokenizer "$ASSETS/stories260K/llama2c/tok512.bin" --out "$MODEL"
fi

DATA=$OUT/data/stories_regen.jsonl
if [ ! -f "$DATA" ]; then
  stamp "self-distil $STORIES stories from BOS"
  mkdir -p "$OUT/data"
  python -m data_tools.regenerate --model "$MODEL" --from-bos "$STORIES" --temperature 1 --seed 0 \
    --stop-token-id 1 --max-new-tokens 384 --batch-size 128 --output "$DATA"
fi

stamp "precompute features"
python -m data_tools.precompute output_dir="$OUT/features" model.path="$MODEL" data=stories260k \
  "data.paths=[$DATA]" precompute.dtype=float32

for head in $HEADS; do
  RUN=$OUT/run-$head
  stamp "train the $head head ($STEPS steps, $NPROC processes)"
  NPROC_PER_NODE=$NPROC launch/train.sh model.path="$MODEL" features_dir="$OUT/features" data=stories260k \
    head="$head" output_dir="$RUN" trainer.dtype=float32 trainer.max_steps="$STEPS" trainer.progress=false
  stamp "validate the $head head in infer/"
  python -m mtp_train.validate --target "$MODEL" --head "$RUN/head" --run-dir "$RUN" --out "$RUN/validation" \
    --num-draft-tokens "$K" --threads "$THREADS"
  if [ "$head" = mtp ]; then
    for format in sglang-nextn eagle; do
      python -m mtp_train.export --head "$RUN/head" --format "$format" --out "$RUN/export-$format" --target "$MODEL" \
        --report "$RUN/validation/report.json" --overwrite
    done
  else
    python -m mtp_train.export --head "$RUN/head" --format eagle --out "$RUN/export-eagle" --target "$MODEL" \
      --report "$RUN/validation/report.json" --overwrite
  fi
done

stamp "done"
python - "$OUT" $HEADS <<'EOF'
import json, sys
from pathlib import Path
out, heads = Path(sys.argv[1]), sys.argv[2:]
print(f"{'head':>7} {'T':>4} {'tau':>6} {'speedup':>8}  conditional acceptance per position   trainer (greedy text)")
for head in heads:
    report = json.loads((out / f"run-{head}" / "validation" / "report.json").read_text())
    replay = report.get("trainer_replay") or {}
    for run in report["runs"]:
        acc = " ".join(f"{a:.3f}" for a in run["conditional_acceptance"])
        trainer = " ".join(f"{a:.3f}" for a in replay.get("cond_top1", [])) if run["temperature"] == 0 else ""
        print(f"{head:>7} {run['temperature']:>4} {run['tau']:>6.3f} {run['speedup']:>8.3f}  {acc:<36} {trainer}")
print(f"artifacts: {out}/ (stories260K/, data/, features/, " + ", ".join(f"run-{h}/" for h in heads) + ")")
EOF
