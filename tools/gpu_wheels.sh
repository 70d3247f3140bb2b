#!/usr/bin/env bash
# bash tools/gpu_wheels.sh [DIR]        (here, with internet; DIR default .whl, git-ignored)
# The wheels tools/gpu_smoke.sh needs on the device machine, which has a CUDA torch and no internet: megatron-core
# and the small pure-Python packages the trainer, the retrieval server and the data tools import, for that
# machine's Python 3.12 on x86-64 Linux, without their dependencies (the machine has numpy, scipy, packaging,
# anyio, h11, click, typing-extensions, annotated-doc). About 6 MB: the device run carries DIR (`run` with
# carry [".whl"]) and gpu_smoke.sh --wheels DIR installs from it with --no-index, only what is missing there.
# vLLM and Transformer Engine are left out on purpose: hundreds of MB, past a call's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
PYVER=${GPU_PYTHON_VERSION:-3.12}
mkdir -p "$DIR"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DIR" \
    megatron-core==0.16.1 pydantic_core==2.46.4 PyStemmer==3.1.0 pydantic==2.13.4 fastapi==0.136.3 \
    uvicorn==0.54.0 starlette==1.10.0 bm25s==0.3.16 typing-inspection==0.4.2 annotated-types==0.7.0
echo "gpu_wheels.sh: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
