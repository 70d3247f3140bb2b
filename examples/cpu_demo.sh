#!/usr/bin/env bash
# bash examples/cpu_demo.sh [--size full|ci] [--seed N] [--work-dir runs/cpu_demo] [--fresh]
# The one-command CPU demo (after `bash tools/install.sh cpu`): synthetic world -> BM25 server -> tiny model ->
# Megatron SFT (DP=2) -> GRPO with vLLM rollouts (TP=2) -> evaluation -> HF export. See megatron_searchr1/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec python -m megatron_searchr1.demo "$@"
