#!/usr/bin/env bash
# Launch the RL trainer on this node; run the same line on every node of a multi-node job.
#   bash examples/run_node.sh examples/grpo_qwen2.5-3b.yaml [KEY=VALUE ...]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/run_node.sh examples/grpo_qwen2.5-7b.yaml   # node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/run_node.sh examples/grpo_qwen2.5-7b.yaml   # node 1
# Each node needs a retrieval server: start one per node before this (python -m megatron_searchr1.search.server
# --faiss-index e5_Flat.index --corpus wiki-18.jsonl --encoder intfloat/e5-base-v2 --faiss-gpu --port 8000), or
# add retrieval.launch=true retrieval.server_args=[...] and the trainer starts it on each node's local rank 0.
set -euo pipefail
config=${1:?usage: run_node.sh CONFIG.yaml [KEY=VALUE ...]}
shift
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
NPROC=${NPROC_PER_NODE:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    --nproc-per-node "$NPROC" -m megatron_searchr1.train "$config" "$@"
