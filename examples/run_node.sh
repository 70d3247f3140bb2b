#!/usr/bin/env bash
# Launch the RL trainer on this node; run the same line on every node of a multi-node job.
#   bash examples/run_node.sh examples/grpo_qwen2.5-3b.yaml [KEY=VALUE ...]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/run_node.sh examples/grpo_qwen2.5-7b.yaml   # node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/run_node.sh examples/grpo_qwen2.5-7b.yaml   # node 1
#
# MASTER_ADDR: node 0's address, reachable from every node (required on nodes 1..NNODES-1; node 0 may leave it
# out: 127.0.0.1). MASTER_PORT (29500), NPROC_PER_NODE (the GPUs this node has).
# Several network interfaces: name the one the nodes reach each other on, e.g. NCCL_SOCKET_IFNAME=eth0 (GPU
# collectives) and GLOO_SOCKET_IFNAME=eth0 (gloo: CPU-side object exchange and the CPU path); otherwise NCCL/gloo
# may pick a loopback or docker interface and hang at the first collective.
# trainer.output_dir must be on a filesystem every node shares (checkpoints, resume): the trainer checks at start.
#
# Retrieval: one server per node, on the CPU, reached at 127.0.0.1 (retrieval.url's default port 8000); start it
# before this line on every node:
#   python -m megatron_searchr1.search.server --faiss-index e5_Flat.index --corpus wiki-18.jsonl \
#       --encoder intfloat/e5-base-v2 --port 8000 --torch-threads 8 &
# or add retrieval.launch=true retrieval.server_args=[...] and the trainer starts one on each node's local rank 0.
# The training GPUs stay the trainer's; to run the server on GPUs, give it GPUs or nodes that do not train and
# point retrieval.url there.
set -euo pipefail
config=${1:?usage: run_node.sh CONFIG.yaml [KEY=VALUE ...]}
shift
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
if [[ -z "${MASTER_ADDR:-}" && "$NODE_RANK" != 0 ]]; then
    # without it this node would wait on its own 127.0.0.1 until the rendezvous times out
    echo "error: NODE_RANK=$NODE_RANK needs MASTER_ADDR=<node 0's address> (the same on every node)" >&2
    exit 2
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
NPROC=${NPROC_PER_NODE:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
# The config (at this launch's world size) and the data files' footers, checked once here in a second: under torchrun a
# mistake would come back from every rank with torchrun's exit code 1 and its failure report around it.
WORLD_SIZE=$((NNODES * NPROC)) python - "$config" "$@" <<'PY'
import sys

from megatron_searchr1.cli import check_data, parse, run_main


def preflight(argv):
    check_data(parse(argv))


sys.exit(run_main(preflight, sys.argv[1:]))
PY

# Exit code: torchrun reports any failing rank as 1, so the ranks write their own codes into a directory
# (megatron_searchr1/cli.py record_exit) and this node exits with the most telling one: 3 when a rank stopped because
# the retrieval server failed (bring it back, run the same line: it resumes), 2 for a mistake found after the launch
# (the `error:` line says what to change), 130 after Ctrl-C, else torchrun's own (1: a crash, read the traceback).
status_dir=$(mktemp -d "${TMPDIR:-/tmp}/searchr1_exit.XXXXXX")
interrupted=0 child=""
trap 'rm -rf "$status_dir"' EXIT
trap 'interrupted=1' INT  # Ctrl-C reaches torchrun and the ranks too: wait for them below
trap '[[ -n $child ]] && kill -TERM "$child" 2>/dev/null' TERM
# in the background so that a TERM sent to this script reaches torchrun; `trap - INT`: a background command would
# otherwise start with Ctrl-C ignored
( trap - INT; SEARCHR1_EXIT_STATUS_DIR="$status_dir" exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --nproc-per-node "$NPROC" \
    -m megatron_searchr1.train "$config" "$@" ) &
child=$!
set +e
rc=0
while :; do
    wait "$child"; rc=$?
    kill -0 "$child" 2>/dev/null || break  # a trapped signal ended `wait`, not torchrun: wait on
done
set -e
code=$rc
if [[ $rc != 0 ]]; then
    for want in 3 2; do  # the ranks' own codes, most telling first
        ranks=$({ grep -lx "$want" "$status_dir"/rank* 2>/dev/null || true; } | sed 's|.*/rank||' | sort -n \
            | tr '\n' ' ')
        if [[ -n "$ranks" ]]; then code=$want; break; fi
    done
    [[ $code == "$rc" && $interrupted == 1 ]] && code=130
    echo "run_node.sh: node $NODE_RANK exits $code (torchrun exited $rc${ranks:+; rank(s) ${ranks% } exited $code})" >&2
fi
exit "$code"
