#!/usr/bin/env bash
# bash tools/gpu_smoke.sh --wheels .whl --log-dir "$OUT"   # one CUDA GPU: NCCL + bf16, under 450 s, logs into $OUT
# bash tools/gpu_smoke.sh --cpu-dry-run --engine hf      # the same phases on CPUs (gloo, fp32), as the tests run it
#
# The first thing to run on a GPU: every path of the trainer that a CPU never takes (NCCL collectives, bf16, CUDA
# memory, the Transformer Engine spec where it imports), at toy size, within one command's time (--budget, 450 s:
# the device machine's `run` gives a command 480). Each phase asserts, and prints one line
#     PHASE name: pass|fail (peak GPU memory X GiB, N s)
# (peak = GPU 0's used memory, sampled every 0.2 s by NVML, CUDA contexts included; n/a in a dry run). In order:
#   numerics a padded-vocabulary Qwen2, a Qwen3 (q/k norm) and a Qwen3-MoE at EP=1, built on the spot
#            (tools/gpu_smoke_numerics.py): engine/trainer log-prob gap within a tolerance, no padded id sampled,
#            one update with a finite loss and a gradient, the generation offload round trip bit-exact;
#   prepare  the synthetic world, a retrieval server over it, gold SFT trajectories, a random tiny Qwen2;
#   sft      3 SFT steps (torchrun, 1 process) -> Megatron checkpoint + HF export; finite losses, gradients;
#   grpo     2 GRPO steps from that checkpoint: rollouts (vLLM if it imports, else the hf engine), weight sync,
#            log-probs, the update; with the distributed optimizer, every offload flag (real CUDA bytes freed and
#            restored around generation), selective recompute and a checkpoint after every step; each step's
#            engine/trainer log-prob gap (train/logprob_gap_engine) at most 0.05 (1e-3 in fp32);
#   resume   the same run resumed from its step-1 checkpoint: step 2 must come out as it did (the distributed
#            optimizer's checkpoint and the offload round trip on CUDA; equal on the CPU, within 1e-3 on a GPU,
#            whose kernels need not be deterministic);
#   convert  HF -> Megatron -> HF of the tiny model; the tensors must come back identical;
#   init     free device memory before Megatron's start-up, after it, and after the first collective on each of
#            its groups (what the NCCL communicators cost);
#   width    one update at Qwen2.5-7B's width (2 layers, 12,288 tokens, vocabulary 152,064, entropy on): finite
#            loss and gradient; peak allocated / reserved memory beside the planner's per-layer and head figures
#            (a dry run: a narrow model).
# A phase gets its own limit or what is left of --budget, whichever is less; one that would start with under 20 s
# left fails as "no time left" without running. Exit status: 0 when every phase passed, else 1.
# Logs: <log-dir>/<phase>.log, written while the phase runs, and <log-dir>/summary.log, a phase's PHASE line (and a
# failure's last log lines) appended when it ends: pass the device machine's $OUT and they come back even when the
# command is killed at its limit.
#
# Flags: --wheels DIR (pip install --no-index, into <work-dir>/site, each wheel whose distribution is not installed),
# --work-dir DIR (default /tmp/gpu_smoke; new, empty, or an earlier run's, which is emptied), --log-dir DIR (default:
# the work dir), --budget S (450), --engine auto|hf|vllm (auto: vllm when it imports),
# --cpu-dry-run (gloo, fp32, no GPU used even when one is there), --timeout-scale F (multiplies each phase's limit).
#
# The GPU machine this was written for (one H100 or H200, Python 3.12, torch with CUDA, no internet) lacks
# megatron-core and the small pure-Python packages; `bash tools/gpu_wheels.sh` downloads them here into .whl
# (git-ignored, about 6 MB) and the device run carries it (`run` with carry [".whl"]). The exact device command is in
# examples/gpus.md ("Smoke check").
# Not carried: vLLM (~400 MB) and Transformer Engine (hundreds of MB) do not fit a 64 MiB call, so there the GRPO
# phase runs the hf engine and the local spec; without bm25s/fastapi the retriever is a word-overlap server on the
# standard library (tools/gpu_smoke_helper.py), enough for a smoke test of the trainer.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS="" WORK=/tmp/gpu_smoke LOGS="" ENGINE=auto DRY=0 SCALE=1 BUDGET=450
while [[ $# -gt 0 ]]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --work-dir) WORK="$2"; shift 2 ;;
        --log-dir) LOGS="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --engine) ENGINE="$2"; shift 2 ;;
        --cpu-dry-run) DRY=1; shift ;;
        --timeout-scale) SCALE="$2"; shift 2 ;;
        -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
        *) echo "gpu_smoke.sh: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$ENGINE" in auto|hf|vllm) ;; *) echo "gpu_smoke.sh: error: --engine must be auto, hf or vllm" >&2; exit 2 ;; esac
PY="${PYTHON:-python3}"
# a work dir this script made before is emptied; any other must be new or empty (never delete a user's files)
if [[ -d "$WORK" && -n "$(ls -A "$WORK")" && ! -f "$WORK/.gpu_smoke" ]]; then
    echo "gpu_smoke.sh: error: --work-dir $WORK is not empty and not an earlier smoke run's: pass a new one" >&2
    exit 2
fi
WORK="$(mkdir -p "$WORK" && cd "$WORK" && pwd)"
find "$WORK" -mindepth 1 -delete
touch "$WORK/.gpu_smoke"
LOGS="$(mkdir -p "${LOGS:-$WORK}" && cd "${LOGS:-$WORK}" && pwd)"
: >"$LOGS/summary.log"
START=$SECONDS
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

if [[ -n "$WHEELS" ]]; then
    # only what is missing: a wheel of an installed distribution stays out (two versions of one package break both)
    missing=()
    for whl in "$WHEELS"/*.whl; do
        dist="$(basename "$whl" | cut -d- -f1)"
        "$PY" -m pip show -q "$dist" >/dev/null 2>&1 || missing+=("$whl")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        echo "gpu_smoke: installing ${#missing[@]} wheels into $WORK/site: $(printf '%s ' "${missing[@]##*/}")"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "${missing[@]}" \
            || { echo "gpu_smoke.sh: error: pip could not install the wheels in $WHEELS" >&2; exit 1; }
        export PYTHONPATH="$PYTHONPATH:$WORK/site"
    fi
fi

imports() { "$PY" -c "import $1" >/dev/null 2>&1; }
if [[ $DRY == 1 ]]; then
    # CPU on purpose, even on a GPU machine: no device visible, and the trainer told so (megatron/initialize.py)
    export CUDA_VISIBLE_DEVICES="" MEGATRON_SEARCHR1_DEVICE=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    DTYPE=float32 USE_TE=false GPU_FLAG=()
else
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_smoke.sh: error: torch sees no CUDA GPU: run it on one, or pass --cpu-dry-run" >&2
        exit 2
    fi
    DTYPE=bfloat16 GPU_FLAG=(--gpu)
    # the Transformer Engine spec when TE imports, else Megatron's local spec
    if imports transformer_engine.pytorch; then USE_TE=true; else USE_TE=false; fi
fi
if [[ $ENGINE == auto ]]; then
    if imports vllm; then ENGINE=vllm; else ENGINE=hf; fi
fi
echo "gpu_smoke: $([[ $DRY == 1 ]] && echo 'CPU dry run (gloo, fp32)' || echo 'GPU (NCCL, bf16)'), engine $ENGINE," \
     "model.use_te=$USE_TE, work dir $WORK"

limit() {  # a phase's limit: its own (scaled), at most what is left of the budget
    local own left=$((BUDGET - (SECONDS - START)))
    own="$("$PY" -c "print(int($1 * $SCALE))")"
    echo $((own < left ? own : left))
}
phase() {  # phase NAME LIMIT_S CMD...: one PHASE line; the status is remembered, the script goes on
    local name="$1" lim; lim="$(limit "$2")"; shift 2
    if ((lim < 20)); then
        echo "PHASE $name: fail (no time left: ${lim} s of the ${BUDGET} s budget)" | tee -a "$LOGS/summary.log"
        FAILED+=("$name")
        return
    fi
    "$PY" tools/gpu_smoke_helper.py phase "$name" --log "$LOGS/$name.log" --summary "$LOGS/summary.log" \
        --timeout "$lim" "${GPU_FLAG[@]}" -- "$@" || FAILED+=("$name")
}
TORCHRUN1=("$PY" -m torch.distributed.run --standalone --nproc_per_node 1)
FAILED=()
GAP=$([[ $DRY == 1 ]] && echo 1e-3 || echo 0.05)  # the mean engine/trainer log-prob gap a GRPO step may show

# The retriever lives for the whole run, in the background; it writes the world first, then its URL.
"$PY" tools/gpu_smoke_helper.py serve --work-dir "$WORK" --url-file "$WORK/url" >"$LOGS/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
wait_url() {
    for _ in $(seq 120); do [[ -s "$WORK/url" ]] && return 0; kill -0 $SERVER 2>/dev/null || break; sleep 1; done
    echo "the retrieval server did not start:"; cat "$LOGS/server.log"; return 1
}
prepare() {
    wait_url && cat "$LOGS/server.log" \
        && "$PY" tools/gpu_smoke_helper.py prepare --work-dir "$WORK" --url "$(cat "$WORK/url")"
}
export -f wait_url prepare
export WORK LOGS SERVER PY
phase numerics 180 "${TORCHRUN1[@]}" tools/gpu_smoke_numerics.py --work-dir "$WORK/numerics"
phase prepare 180 bash -c prepare
URL="$(cat "$WORK/url" 2>/dev/null || echo http://127.0.0.1:9)"

W="$WORK/world" M="$WORK/tiny_model"
SFT=("${TORCHRUN1[@]}" -m megatron_searchr1.sft examples/sft_tiny_cpu.yaml
    "model.path=$M" "model.dtype=$DTYPE" "model.use_te=$USE_TE" "data.dataset_dir=$W/sft"
    "data.datasets=[synthetic_sft_train]" "data.batch_size=4" "trainer.total_steps=3" "trainer.output_dir=$WORK/sft")
phase sft 180 bash -c "$(printf '%q ' "${SFT[@]}") && '$PY' tools/gpu_smoke_helper.py steps '$WORK/sft/metrics.jsonl' \
    --steps 3 --prefix sft"

# A 3-step SFT model earns no reward, so every GRPO advantage is 0: the entropy bonus gives each update a gradient
# (checked > 0 below) and the KL loss runs the reference model, so the step does all its work.
GRPO=("${TORCHRUN1[@]}" -m megatron_searchr1.train examples/grpo_tiny_cpu.yaml
    "model.path=$M" "model.megatron_ckpt=$WORK/sft" "model.dtype=$DTYPE" "model.use_te=$USE_TE"
    "parallel.tp=1" "rollout.engine=$ENGINE" "retrieval.url=$URL"
    "data.train_files=[$W/train.parquet]" "data.val_files=[$W/validation.parquet]" "data.val_max_samples=8"
    "data.train_batch_size=2" "algo.ppo_mini_batch_size=2" "rollout.n=2" "rollout.max_turns=2"
    "algo.use_kl_loss=true" "algo.entropy_coeff=0.001"
    "parallel.use_distributed_optimizer=true" "model.recompute=selective" "model.param_offload=true"
    "model.grad_offload=true" "model.optimizer_offload=true" "model.ref_offload=true"
    "trainer.total_steps=2" "trainer.save_freq=1" "trainer.keep_last=2" "trainer.val_before_train=false"
    "trainer.test_freq=0")
phase grpo 300 bash -c "$(printf '%q ' "${GRPO[@]}" "trainer.output_dir=$WORK/grpo") \
    && '$PY' tools/gpu_smoke_helper.py steps '$WORK/grpo/metrics.jsonl' --steps 2 --prefix actor --max-gap $GAP"

TOL=$([[ $DRY == 1 ]] && echo 0 || echo 1e-3)
phase resume 300 bash -c "$(printf '%q ' "${GRPO[@]}" "trainer.output_dir=$WORK/grpo_resume" \
        "trainer.resume=$WORK/grpo/checkpoints/step_000001" "trainer.export_hf=false") \
    && '$PY' tools/gpu_smoke_helper.py same '$WORK/grpo/metrics.jsonl' '$WORK/grpo_resume/metrics.jsonl' --step 2 \
        --keys actor/pg_loss,actor/grad_norm,actor/entropy,actor/kl_loss,reward/mean --tol $TOL"

phase convert 180 bash -c "'$PY' checkpoints_convert/hf_to_megatron.py --hf-dir '$M' --out-dir '$WORK/mcore' \
    && '$PY' checkpoints_convert/megatron_to_hf.py --ckpt-dir '$WORK/mcore' --out-dir '$WORK/hf_back' \
    && '$PY' tools/gpu_smoke_helper.py compare '$M' '$WORK/hf_back'"

phase init 180 "${TORCHRUN1[@]}" tools/gpu_smoke_helper.py init

WIDTH=()
[[ $DRY == 1 ]] && WIDTH=(--hidden 256 --heads 4 --kv-heads 2 --ffn 512 --vocab 8192 --tokens 2048)
phase width 300 "${TORCHRUN1[@]}" tools/gpu_smoke_helper.py width "${WIDTH[@]}"

if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "gpu_smoke: FAILED: ${FAILED[*]} (logs in $LOGS; $((SECONDS - START)) s)" | tee -a "$LOGS/summary.log"
    exit 1
fi
echo "gpu_smoke: all phases passed (logs in $LOGS; $((SECONDS - START)) s)" | tee -a "$LOGS/summary.log"
