#!/usr/bin/env bash
# Head training under torchrun, one node or many; every argument is a Hydra override for mtp_train.train.
# It runs torchrun's agent through mtp_train.torchrun, in this script's own process (exec), which guarantees:
#   - a user's mistake (features of another hidden size, a missing folder, output_dir in use by another run) is
#     one line, printed once for all of this node's ranks, exit code 2, without torchrun's traceback box;
#   - SIGTERM, SIGINT and SIGHUP to this script are forwarded to the workers (exit 128 + the signal), and no
#     worker outlives the launcher, even when it or its whole process group is SIGKILLed;
#   - one run per output_dir: rank 0 holds output_dir/run.lock (a stale one, left by a killed run, is taken over).
#
#   launch/train.sh model=llama3_1_8b model.path=/models/Llama-3.1-8B-Instruct features_dir=/data/feat-8b
#   NPROC_PER_NODE=2 launch/train.sh features_dir=DIR trainer.dtype=float32 trainer.autocast=true  # CPU: gloo, 2 processes
#   launch/train.sh model=llama3_2_1b model.path=DIR features=online   # no feature store: the target runs in the job
#   NPROC_PER_NODE=8 launch/train.sh model=llama3_1_70b model.path=DIR features=online online.tp=4  # 2 copies x 4 GPUs
#   # many nodes: run on every node with the same MASTER_ADDR (node 0's address) and its own NODE_RANK
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 launch/train.sh model=llama3_1_70b trainer=zero3 ...
#   # elastic rendezvous instead of fixed node ranks: RDZV=c10d (NODE_RANK is then assigned by torchrun)
#
# Environment: NNODES (default: SLURM_NNODES or 1), NODE_RANK (SLURM_NODEID or 0), NPROC_PER_NODE (GPUs seen,
# or 1 without GPUs), MASTER_ADDR, MASTER_PORT (29500), RDZV (static | c10d), RDZV_ID (mtp-train),
# PYTHON (the interpreter; default python).
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
NPROC_PER_NODE=${NPROC_PER_NODE:-$(( GPUS > 0 ? GPUS : 1 ))}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV=${RDZV:-static}
if [ "$GPUS" -eq 0 ]; then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}  # DeepSpeed on CPU: gloo, no CUDA probing
fi

if [ "$NNODES" -eq 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  dist_args=(--standalone --nproc_per_node "$NPROC_PER_NODE")
elif [ "$RDZV" = c10d ]; then
  dist_args=(--nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --rdzv_backend c10d
             --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR}:$MASTER_PORT" --rdzv_id "${RDZV_ID:-mtp-train}")
else
  dist_args=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE"
             --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "$MASTER_PORT")
fi

set -x
exec "${PYTHON:-python}" -m mtp_train.torchrun "${dist_args[@]}" -m mtp_train.train "$@"
