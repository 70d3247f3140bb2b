#!/usr/bin/env bash
# One node of examples/slurm_grpo.sh (srun runs it once per node):
#   bash examples/slurm_node.sh STATUS_DIR CONFIG.yaml [KEY=VALUE ...]
# Starts this node's retrieval server (RETRIEVAL_ARGS, on 127.0.0.1:RETRIEVAL_PORT, log in $OUTPUT_DIR/slurm/),
# waits until it listens (RETRIEVAL_START_TIMEOUT seconds, 900: a wiki-18 index loads in minutes), runs
# examples/run_node.sh as node $SLURM_NODEID of $SLURM_NNODES, stops the server, and writes run_node.sh's exit code to
# STATUS_DIR/node<N>.
set -uo pipefail
status=$1 config=$2
shift 2
node=${SLURM_NODEID:?slurm_node.sh runs under srun (examples/slurm_grpo.sh)}
port=${RETRIEVAL_PORT:-8000}
log="$OUTPUT_DIR/slurm/server_node$node.log"
finish() { echo "$1" > "$status/node$node"; exit "$1"; }
: > "$log"  # made here: the background server opens it only after the wait loop's first grep may have run
# shellcheck disable=SC2086  # RETRIEVAL_ARGS is a list of flags
python -m megatron_searchr1.search.server $RETRIEVAL_ARGS --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null' EXIT
for ((waited = 0; ; waited++)); do
    grep -q "Retrieval server listening" "$log" && break
    if ! kill -0 "$server" 2>/dev/null || ((waited >= ${RETRIEVAL_START_TIMEOUT:-900})); then
        echo "error: node $node: the retrieval server did not start (RETRIEVAL_ARGS=$RETRIEVAL_ARGS); $log ends:" >&2
        tail -n 5 "$log" >&2
        finish 2
    fi
    sleep 1
done
NNODES=$SLURM_NNODES NODE_RANK=$node bash examples/run_node.sh "$config" "$@" \
    "retrieval.url=http://127.0.0.1:$port/retrieve" "trainer.output_dir=$OUTPUT_DIR"
finish $?
