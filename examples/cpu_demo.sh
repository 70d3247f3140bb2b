#!/usr/bin/env bash
# bash examples/cpu_demo.sh [--size full|ci] [--seed N] [--work-dir runs/cpu_demo] [--fresh] [--base DIR|scratch]
#                           [--protocol search_r1|tool_calls]
# The one-command CPU demo (after `bash tools/install.sh cpu`): synthetic worlds -> the shipped base model
# (examples/demo_base) -> Megatron SFT (DP=2) -> BM25 server -> GRPO with vLLM rollouts (TP=2) -> evaluation -> HF
# export. --protocol tool_calls runs it in the model's chat template with JSON tool calls (examples/tool_calls.md).
# See megatron_searchr1/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec python -m megatron_searchr1.demo "$@"
