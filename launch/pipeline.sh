#!/usr/bin/env bash
# The whole pipeline on the embedded default, stories260K, in one command:
#   1. convert the llama2.c checkpoint to a Hugging Face folder (first use only);
#   2. self-distil: the target writes stories from BOS through infer/ (half at T=1, half at T=0.7; seeded);
#   3. precompute the target's features through infer/ (sharded safetensors + manifest), with the three layers an
#      EAGLE-3 head fuses;
#   4. train each head on the same features with DeepSpeed under torchrun (gloo on a CPU): TTT unroll of 4 steps,
#      the recipe of conf/recipe/stories260k.yaml at 16 records a step, fp32 weights with the linear layers in bf16
#      (trainer.autocast) where bf16 matmuls are native (an AVX2-only CPU emulates them, so there they stay fp32);
#      RECIPE=quick (the default) trains 600 steps unrolling steps 1-3 over half of each record's anchors
#      (CHAIN_SHARE=0.5), RECIPE=best 700 steps over all of them, slower, for stronger heads; on a CPU the heads
#      train side by side (below); each head's output goes to OUT/run-HEAD.log (timings behind these
#      choices: docs/benchmark_history.md);
#   5. validate each in infer/ (speculative decoding on 64 held-out story openings x 128 tokens: conditional
#      acceptance per position, tau, speedup, the trainer's per-step top-1 on the same text);
#   6. export each head in the runtime format (EAGLE-3 also as eagle3 and speculators), with its recommended K;
#   7. print the heads' figures side by side.
# HEADS="mtp eagle3 eagle1" adds the EAGLE-1 ablation on the same features; HEADS="mtp eagle3 block" the block
# drafter (BLOCK_STEPS steps whatever the recipe: its mask rows learn slowly, docs/block_head.md).
# ONLINE=1: no precompute stage and no feature files: each training rank's copy of the target computes its micro
# batches' features in the training job (features=online, mtp_train.online), the same records as step 3 would store.
#
#   launch/pipeline.sh                          # defaults below; every variable can be overridden
#   STEPS=400 STORIES=1500 launch/pipeline.sh   # a quicker run
set -euo pipefail
cd "$(dirname "$0")/.."

ASSETS=${ASSETS:-../shared/assets}
OUT=${OUT:-artifacts}
MODEL=$OUT/stories260K
STORIES=${STORIES:-3000}       # self-distilled stories from BOS (half at T=1, half at T=0.7)
RECIPE=${RECIPE:-quick}        # quick: under 15 minutes on a 2-core AVX2 CPU; best: the stronger heads (README)
case "$RECIPE" in
  quick) STEPS=${STEPS:-600}; CHAIN_SHARE=${CHAIN_SHARE:-0.5} ;;
  best) STEPS=${STEPS:-}; CHAIN_SHARE=${CHAIN_SHARE:-1} ;;
  *) echo "pipeline: RECIPE=$RECIPE; the recipes are: quick best" >&2; exit 2 ;;
esac
STEPS=${STEPS:-}               # optimizer steps per head (best: conf/recipe/stories260k.yaml's)
HEADS=${HEADS:-mtp eagle3}     # heads to train on the same features: mtp, eagle3, eagle1, block
BATCH=${BATCH:-16}             # records per optimizer step of a head, over all its processes (the recipe's global batch)
JOBS=${JOBS:-}                 # heads trained at once (default: on a CPU, one per core; on GPUs, one)
NPROC=${NPROC:-}               # torchrun processes per head (default: on a CPU, its cores / JOBS; else every GPU)
K=${K:-4}                      # draft tokens per step when validating
BLOCK_K=${BLOCK_K:-15}         # the block head's (its block_size - 1: its acceptance at every position it drafts)
BLOCK_STEPS=${BLOCK_STEPS:-2000}  # the block head's optimizer steps, whatever RECIPE (docs/block_head.md: its mask rows
                                 # learn slowly, and it gains on to 2000 where the others stop gaining by 600)
THREADS=${THREADS:-1}          # torch threads per process: tiny models run best on one
AUTOCAST=${AUTOCAST:-auto}     # heads' linear layers in bf16 (trainer.autocast): auto = where bf16 matmuls are native
ONLINE=${ONLINE:-0}            # 1: features computed in the training job (features=online), nothing precomputed
case "$ONLINE" in 0|1) ;; *) echo "pipeline: ONLINE=$ONLINE; use ONLINE=0 (precomputed features) or ONLINE=1" >&2; exit 2 ;; esac
CHAIN_SHARE=${CHAIN_SHARE:-1}  # loss.chain_share: 0.5 unrolls steps 1-3 over half the anchors, for less training time
export OMP_NUM_THREADS=$THREADS
for head in $HEADS; do  # before the stages that take minutes
  if [ ! -f "conf/head/$head.yaml" ]; then
    echo "pipeline: HEADS has '$head'; the heads are: $(cd conf/head && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
    exit 2
  fi
done
if ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=cpu; fi
start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - start ))s] $*"; }
if [ "$AUTOCAST" = auto ]; then  # the device the trainer picks (cuda when there is one)
  AUTOCAST=$(python -c "import torch; from mtp_train.distributed import native_bf16
print(str(native_bf16(torch.device('cuda' if torch.cuda.is_available() else 'cpu'))).lower())")
  echo "pipeline: trainer.autocast=$AUTOCAST (true where bf16 matmuls are native)"
fi

if [ ! -f "$MODEL/config.json" ]; then
  stamp "convert stories260K"
  python -m data_tools.convert_llama2c --checkpoint "$ASSETS/stories260K/llama2c/stories260K.bin" \
    --tokenizer "$ASSETS/stories260K/llama2c/tok512.bin" --out "$MODEL"
fi

# Self-distilled stories from BOS, half sampled at T=1 and half at T=0.7 (seeds continue: story i has seed i): the
# best of three data recipes on the validation (docs/benchmark_history.md, "Figures moved out of the code").
HALF=$(( STORIES / 2 ))
DATA_T1=$OUT/data/stories_t1.jsonl
DATA_T07=$OUT/data/stories_t07.jsonl
mkdir -p "$OUT/data"
# The two halves run side by side, one process (and one thread) each, as many as the machine has cores for: on the
# 2-core CPU the self-distillation then takes the time of its longer half. A failing half stops the pipeline; the
# other is stopped with it (each writes its file whole, by rename, or not at all; kill_jobs stops a job's processes).
kill_tree() { local child; for child in $(pgrep -P "$1" || true); do kill_tree "$child"; done; kill "$1" 2>/dev/null || true; }
kill_jobs() { local job; for job in $(jobs -rp); do kill_tree "$job"; done; }
trap kill_jobs EXIT
half_pids=()
if [ ! -f "$DATA_T1" ]; then
  stamp "self-distil $HALF stories from BOS at T=1 (in the background)"
  python -m data_tools.regenerate --model "$MODEL" --from-bos "$HALF" --temperature 1 --seed 0 \
    --stop-token-id 1 --max-new-tokens 384 --batch-size 128 --output "$DATA_T1" --no-progress &
  half_pids+=($!)
fi
if [ ! -f "$DATA_T07" ]; then
  stamp "self-distil $(( STORIES - HALF )) stories from BOS at T=0.7"
  python -m data_tools.regenerate --model "$MODEL" --from-bos "$(( STORIES - HALF ))" --temperature 0.7 \
    --seed "$HALF" --stop-token-id 1 --max-new-tokens 384 --batch-size 128 --output "$DATA_T07" &
  half_pids+=($!)
fi
for pid in "${half_pids[@]}"; do wait "$pid"; done

# What the stages below spread over: a node's GPUs, or a CPU's cores.
if command -v nvidia-smi >/dev/null 2>&1; then
  on_gpus=true
  gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  workers=$(( gpus > 0 ? gpus : 1 ))
else
  on_gpus=false
  cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_NUM_THREADS, set above
  workers=$cores
fi

# The precompute on every worker: data-parallel ranks, each its share of the shards, writing the same bytes as one
# process would (tests/test_data_precompute.py); two shards a rank, so the ranks finish together (the trainer's
# record order does not depend on the shards).
precompute=(python -m data_tools.precompute)
if [ "$workers" -gt 1 ]; then
  precompute=(python -m torch.distributed.run --standalone --nproc_per_node "$workers" -m data_tools.precompute)
fi
if [ "$ONLINE" = 1 ]; then  # the trainer reads the conversations and runs the target itself
  features=(features=online online.dtype=float32 "data.paths=[$DATA_T1,$DATA_T07]")
else
  stamp "precompute features ($workers process(es))"
  "${precompute[@]}" output_dir="$OUT/features" model.path="$MODEL" data=stories260k \
    "data.paths=[$DATA_T1,$DATA_T07]" precompute.dtype=float32 head=eagle3 precompute.overwrite=true \
    precompute.records_per_shard=$(( (STORIES + 2 * workers - 1) / (2 * workers) ))
  features=(features_dir="$OUT/features")
fi

# Each head: trained, validated in infer/ (speculative decoding on 64 held-out story openings x 128 tokens), exported
# in the runtime's format with its recommended K per batch size. The default MTP / EAGLE-1 heads read the target's
# pre-norm state, so no vLLM/SGLang layout serves them as they are; an EAGLE-3 head also exports as speculators (vLLM)
# and, unless its residual starts from the normed fused state (head.norm_before_residual, the default: SGLang's layer
# has no such flag), as eagle3 (SGLang) (mtp_train.export --help says which head each format takes).
build_head() {
  local head=$1 run=$OUT/run-$1
  local formats=(runtime) head_steps=("${steps[@]}")
  if [ "$head" = block ]; then head_steps=(trainer.max_steps="$BLOCK_STEPS"); fi
  stamp "train the $head head ($NPROC process(es) x $MICRO records a step; log: $OUT/run-$head.log)" >&3
  NPROC_PER_NODE=$NPROC launch/train.sh model.path="$MODEL" "${features[@]}" data=stories260k \
    head="$head" output_dir="$run" trainer.dtype=float32 trainer.autocast="$AUTOCAST" trainer.progress=false \
    trainer.eval_every=0 trainer.micro_batch_size="$MICRO" trainer.grad_accum=1 validate.enabled=false \
    loss.chain_share="$CHAIN_SHARE" "${head_steps[@]}"
  stamp "validate the $head head in infer/" >&3
  python -m mtp_train.validate --target "$MODEL" --head "$run/head" --run-dir "$run" --out "$run/validation" \
    --num-draft-tokens "$(if [ "$head" = block ]; then echo "$BLOCK_K"; else echo "$K"; fi)" --threads "$THREADS"
  if [ "$head" = eagle3 ]; then
    formats+=(speculators)
    if python -c "import json, sys; sys.exit(json.load(open(sys.argv[1])).get('norm_before_residual', False))" \
        "$run/head/config.json"; then formats+=(eagle3); fi
  fi
  for format in "${formats[@]}"; do
    python -m mtp_train.export --head "$run/head" --format "$format" --out "$run/export-$format" --target "$MODEL" \
      --report "$run/validation/report.json" --overwrite
  done
  stamp "the $head head is done" >&3
}

# Heads side by side: on a CPU each head trains in its own processes, JOBS at a time, rather than one after another
# on all cores: data-parallel ranks wait at every step for the slower one, and a bigger micro batch spreads a step's
# fixed costs (docs/benchmark_history.md, "Figures moved out of the code"). On GPUs, one head at a time on all of them.
heads=($HEADS)
if $on_gpus; then
  JOBS=${JOBS:-1}
  NPROC=${NPROC:-$gpus}
else
  JOBS=${JOBS:-$(( ${#heads[@]} < cores ? ${#heads[@]} : cores ))}
  NPROC=${NPROC:-$(( cores / JOBS > 0 ? cores / JOBS : 1 ))}
fi
if [ "$NPROC" -lt 1 ] || [ $(( BATCH % NPROC )) -ne 0 ]; then
  echo "pipeline: BATCH=$BATCH records a step must split evenly over NPROC=$NPROC processes per head" >&2
  exit 2
fi
MICRO=$(( BATCH / NPROC ))
steps=()
if [ -n "$STEPS" ]; then steps=(trainer.max_steps="$STEPS"); fi
exec 3>&1  # the stamps of the heads' jobs reach the console; the rest of their output goes to their logs
declare -A job_of
stopped=false  # a head failed: the others are stopped, none is started
for head in "${heads[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || { stopped=true; break 2; }; done
  build_head "$head" > "$OUT/run-$head.log" 2>&1 &
  job_of[$head]=$!
done
while ! $stopped && [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n || stopped=true; done
if $stopped; then kill_jobs; fi
failed=()
for head in "${heads[@]}"; do
  status=0
  if [ -z "${job_of[$head]:-}" ]; then status=-1; else wait "${job_of[$head]}" || status=$?; fi
  if [ "$status" -eq 0 ]; then continue; fi
  failed+=("$head")
  if [ "$status" -gt 0 ] && [ "$status" -ne 143 ]; then  # 143: stopped after another head failed
    echo "pipeline: the $head head failed (exit $status); the end of $OUT/run-$head.log:" >&2
    tail -n 30 "$OUT/run-$head.log" >&2
  fi
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "pipeline: stopped; heads not built: ${failed[*]}" >&2
  exit 1
fi

stamp "done"
python - "$OUT" "$ONLINE" $HEADS <<'EOF'
import json, sys
from pathlib import Path
out, online, heads = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3:]
print("conditional acceptance at draft position k (accepted / reached, +- SE); trainer: its conditional top-1 at the "
      "runtime's verify steps of the same greedy text")
print(f"{'head':>7} {'T':>3} {'tau':>6} {'speedup':>8}  {'acceptance per position':<44} trainer")
for head in heads:
    report = json.loads((out / f"run-{head}" / "validation" / "report.json").read_text())
    replay = report.get("trainer_replay") or {}
    for run in report["runs"]:
        acc = " ".join(f"{a:.3f}+-{e:.3f}" for a, e in zip(run["conditional_acceptance"],
                                                           run["conditional_acceptance_se"]))
        trainer = " ".join(f"{a:.3f}" for a in replay.get("at_verify_steps", [])) if run["temperature"] == 0 else ""
        print(f"{head:>7} {run['temperature']:>3g} {run['tau']:>6.3f} {run['speedup']:>8.3f}  {acc:<44} {trainer}")
    summary = json.loads((out / f"run-{head}" / "summary.json").read_text())
    vocab = summary.get("draft_vocab") or {}
    if vocab:
        print(f"{'':>7} draft vocabulary {vocab['size']}: held-out target mass covered by probability "
              f"{vocab['mass_probability_eval']:.4f}, by frequency {vocab['mass_frequency_eval']:.4f}")
if online:
    print("features: online (computed in each training job; no feature files written)")
else:
    manifest = json.loads((out / "features" / "manifest.json").read_text())
    print(f"features: precomputed, {manifest['num_bytes'] / 1e9:.2f} GB in {out}/features "
          f"({manifest['bytes_per_token']['stored']:.0f} bytes a token)")
stored = "" if online else "features/, "
print(f"artifacts: {out}/ (stories260K/, data/, {stored}" + ", ".join(f"run-{h}/" for h in heads) + ")")
EOF
