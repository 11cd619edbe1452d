#!/usr/bin/env bash
# Wheels the GPU check needs that the lent GPU machine's image lacks (its python3 is 3.12 with torch, transformers,
# numpy, ninja, einops, psutil, py-cpuinfo, msgpack, tqdm, requests, click, tabulate, nvidia-ml-py; no flashinfer,
# deepspeed, hydra or pydantic), downloaded here into .whl/ (ignored by git, about 27 MB) to travel with the
# device tool's `carry: [".whl"]`. The check's command then starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD || exit; bash launch/gpu_check.sh
# FlashInfer 0.6.6 is the version the check ran on (an H200); nvidia-cutlass-dsl, which it lists, is left out: only
# its CuTe-DSL kernels import it, and it would not fit the 64 MiB a call may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl flashinfer-python==0.6.6 "apache-tvm-ffi==0.1.15.post2" "nvidia-cudnn-frontend==1.32.0" \
    hydra-core==1.3.2 omegaconf==2.3.0 hjson==3.1.0 pydantic==2.11.7 pydantic-core==2.33.2 annotated-types==0.7.0 \
    typing-inspection==0.4.1
# DeepSpeed and antlr4 (hydra's parser runtime) publish source only: their wheels are built here (pure Python).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8 antlr4-python3-runtime==4.9.3
du -sh .whl
