#!/usr/bin/env bash
#SBATCH --job-name=searchr1-grpo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
#
# RL training on several SLURM nodes, submitted from the repository's root:
#   OUTPUT_DIR=/shared/runs/grpo7b sbatch examples/slurm_grpo.sh examples/grpo_qwen2.5-7b.yaml [KEY=VALUE ...]
#   OUTPUT_DIR=/shared/runs/grpo7b sbatch --nodes 4 examples/slurm_grpo.sh examples/grpo_qwen2.5-7b.yaml
#
# srun starts examples/slurm_node.sh once per node (--ntasks-per-node=1): it starts that node's retrieval server on
# 127.0.0.1:$RETRIEVAL_PORT, waits until it answers, then runs examples/run_node.sh (one torchrun per node, its
# ranks = the node's GPUs) with NNODES / NODE_RANK from SLURM and node 0 as MASTER_ADDR.
#   OUTPUT_DIR        required: trainer.output_dir, on a filesystem every node shares (checked at start); the
#                     nodes' server logs and exit codes go to $OUTPUT_DIR/slurm/
#   RETRIEVAL_ARGS    the server's index flags (default: the wiki-18 e5 Flat index in the submit directory);
#                     RETRIEVAL_THREADS its CPU threads (8)
#   RETRIEVAL_PORT    8000;  MASTER_PORT 29500;  NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME as for run_node.sh
# Exit code (the job's, what `sacct` shows): the most telling node's, as run_node.sh reports it: 3 the retrieval
# server failed (resubmit the same line: the run resumes), 2 a mistake (its `error:` line says what to change),
# 130 interrupted, else the first failing node's (1: a crash).
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"  # sbatch runs a copy of this file from its spool directory
if [[ -z "${OUTPUT_DIR:-}" ]]; then
    echo "error: set OUTPUT_DIR=<a directory every node shares> (the run's trainer.output_dir)" >&2
    exit 2
fi
if [[ $# -lt 1 ]]; then
    echo "error: usage: OUTPUT_DIR=DIR sbatch examples/slurm_grpo.sh CONFIG.yaml [KEY=VALUE ...]" >&2
    exit 2
fi
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")  # not `| head -n 1`: under pipefail its SIGPIPE fails
MASTER_ADDR=${hosts%%$'\n'*}                           # the job on a long node list
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-29500} OUTPUT_DIR
RETRIEVAL_ARGS=${RETRIEVAL_ARGS:-"--faiss-index e5_Flat.index --corpus wiki-18.jsonl --encoder intfloat/e5-base-v2"}
export RETRIEVAL_ARGS="$RETRIEVAL_ARGS --torch-threads ${RETRIEVAL_THREADS:-8}"
status="$OUTPUT_DIR/slurm/job_${SLURM_JOB_ID:-0}"
mkdir -p "$status"
rm -f "$status"/node*  # a requeued job keeps its id: no code of an earlier attempt
echo "slurm_grpo.sh: $SLURM_NNODES nodes, master $MASTER_ADDR:$MASTER_PORT, output $OUTPUT_DIR"
set +e
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash examples/slurm_node.sh "$status" "$@"
rc=$?
set -e
# srun reports the highest task code (a node killed after another failed shows 137): the nodes' own codes instead
code=$rc
for want in 3 2 130; do
    if grep -qx "$want" "$status"/node* 2>/dev/null; then code=$want; break; fi
done
echo "slurm_grpo.sh: exit $code (srun $rc; nodes: $(cd "$status" && grep -H . node* 2>/dev/null | tr '\n' ' '))"
exit "$code"
