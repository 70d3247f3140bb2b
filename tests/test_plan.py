"""megatron_searchr1/plan.py (planner/counts.py, memory.py, render.py): byte counts against what torch allocates for
tiny models, the shipped recipes' verdicts, the formulas against hand counts and vLLM's own classes, and the command
line's one-line errors. Which states each phase holds: tests/test_plan_phases.py."""
import os
import subprocess
import sys
import time

import pytest
import torch

from megatron_searchr1 import plan
from megatron_searchr1.cli import UsageError
from tests.dist_utils import REPO

CONFIGS = os.path.join(REPO, "tests", "models", "real_configs")
TINY = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=300, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=False)
TINY_MOE = dict(TINY, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=8, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0], norm_topk_prob=True)


@pytest.fixture(scope="module")
def megatron_world():
    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    initialize_megatron(tp=1, pp=1, device="cpu")
    yield
    destroy_megatron()


def recipe(name, overrides=(), nodes=1):
    model = ("Qwen3-30B-A3B" if "30b-a3b" in name else "Qwen2.5-7B-Instruct" if "7b" in name
             else "Qwen2.5-3B-Instruct")
    return plan.load_plan_inputs(os.path.join(REPO, "examples", f"{name}.yaml"), list(overrides), nodes * 8,
                                 os.path.join(CONFIGS, f"{model}.json"))


# ---- byte counts equal what torch allocates ------------------------------------------------------------------
def _allocated(hf, dtype, distributed):
    """(weights, main grads, grad buffer, optimizer state) bytes of a tiny actor after one real optimizer step."""
    from megatron_searchr1.megatron.optimizer import build_optimizer
    from megatron_searchr1.trainer.roles import build_actor

    actor = build_actor(hf, params_dtype=dtype, use_distributed_optimizer=distributed)
    opt, _ = build_optimizer(actor, lr=1e-3)
    actor.zero_grad_buffer()
    opt.zero_grad()
    actor(torch.randint(0, hf["vocab_size"], (2, 8)), None, None).float().mean().backward()
    actor.finish_grad_sync()
    assert opt.step()[0]
    bare = actor.module
    weights = sum(p.numel() * p.element_size() for p in bare.parameters())
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in bare.parameters())
    buffer = sum(b.grad_data.numel() * b.grad_data.element_size() for b in actor.buffers)
    inners = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]  # EP > 1: dense + experts
    states = sum(t.numel() * t.element_size() for inner in inners for s in inner.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0)  # exp_avg, exp_avg_sq (not the step counter)
    model_storage = {p.untyped_storage().data_ptr() for p in bare.parameters()}
    masters = sum(p.numel() * p.element_size() for inner in inners for g in inner.param_groups for p in g["params"]
                  if p.untyped_storage().data_ptr() not in model_storage)  # fp32 copies, not views of the model
    return weights, grads, buffer, states + masters


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("distributed", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_weights_grads_and_optimizer_bytes_equal_torch(megatron_world, dtype, distributed, tied):
    hf = dict(TINY, tie_word_embeddings=tied)
    counts = plan.count_params(plan.read_dims_of(hf), tp=1, pp=1)
    n = counts.stages[0].actor
    weights, grads, buffer, optimizer = _allocated(hf, getattr(torch, dtype), distributed)
    assert weights == n * plan.DTYPE_BYTES[dtype]
    assert grads == n * 4  # fp32 main grads (grad_reduce_in_fp32)
    assert n * 4 <= buffer < n * 4 + 4096  # the buffer adds Megatron's bucket padding only
    assert optimizer == n * plan.optimizer_bytes_per_param(dtype)  # DP = 1: the shard is everything


def test_moe_bytes_equal_torch_at_ep1(megatron_world):
    """A tiny Qwen3-MoE (one dense layer, one MoE layer of 4 experts) at EP = 1: every expert on the rank."""
    dims = plan.read_dims_of(TINY_MOE)
    counts = plan.count_params(dims, tp=1, pp=1)
    st = counts.stages[0]
    assert st.actor_experts == 4 * 3 * 16 * 32  # fc1 (2 x 16, 32) + fc2 (32, 16) per expert
    weights, grads, buffer, optimizer = _allocated(TINY_MOE, torch.bfloat16, True)
    assert weights == st.actor * 2 and grads == st.actor * 4
    assert st.actor * 4 <= buffer < st.actor * 4 + 2 * 4096  # two buffers (dense, experts), padding only
    assert optimizer == st.actor * plan.optimizer_bytes_per_param("bfloat16")


def test_expert_tp_shards_the_experts_apart_from_tp(megatron_world):
    """TP 2 x EP 2: a rank holds 2 of the 4 experts, at half width with expert-TP 2 (Megatron's default, = TP) and
    whole with expert-TP 1; the attention and the dense layer stay at TP 2 either way."""
    dims = plan.read_dims_of(TINY_MOE)
    per_expert = 3 * 16 * 32  # fc1 (2 x 16, 32) + fc2 (32, 16)
    default, whole = (plan.count_params(dims, tp=2, pp=1, ep=2, etp=etp).stages[0] for etp in (None, 1))
    assert (default.actor_experts, whole.actor_experts) == (2 * per_expert // 2, 2 * per_expert)
    assert whole.actor - whole.actor_experts == default.actor - default.actor_experts


@pytest.mark.slow
def test_moe_bytes_equal_torch_at_ep2(megatron_world):
    """Two ranks at EP = 2 (torchrun, gloo), this file as the worker: each holds 2 of the 4 experts and the whole
    dense part; with the distributed optimizer the dense state is sharded over DP = 2 and the experts' over
    expert-DP = 1, which is the plan's optimizer shard summed over the two ranks. Every process group Megatron
    runs a collective over in that step is one the planner counts an NCCL communicator for."""
    from tests.dist_utils import rank_results, run_torchrun

    out = run_torchrun(__file__, 2, timeout=600)
    ranks = rank_results(out)
    assert len(ranks) == 2, out[-3000:]
    counts = plan.count_params(plan.read_dims_of(TINY_MOE), tp=1, pp=1, ep=2)
    st = counts.stages[0]
    assert st.actor_experts == plan.count_params(plan.read_dims_of(TINY_MOE), tp=1, pp=1).stages[0].actor_experts // 2
    for r in ranks:
        assert r["params"] == st.actor and r["weights"] == st.actor * 2 and r["grads"] == st.actor * 4
        assert r["experts"] == st.actor_experts
    cfg, _ = recipe("grpo_qwen2.5-3b", ["parallel.tp=1", "parallel.ep=2", "parallel.sequence_parallel=false",
                                        "rollout.engine_tp=1", "model.dtype=bfloat16"], nodes=1)
    result = plan.plan_memory(cfg, counts, world=2, gpu_bytes=80 * plan.GiB, gpus_per_node=2)
    planned = result.phase("update peak").items["actor optimizer"]
    assert sum(r["optimizer"] for r in ranks) == 2 * planned
    # the groups Megatron ran collectives over in that step (fwd/bwd/optimizer step) are among the communicators
    # the planner counts (named by the part of its description before ":")
    counted = {name.split(":")[0] for name, _ in result.nccl}
    for r in ranks:
        assert {"expert-parallel", "data-parallel with CP"} <= set(r["groups"]) <= counted, (r["groups"], counted)


def _record_collective_groups() -> list:
    """Make the collectives Megatron calls (torch.distributed's, and the references its buffers and TP mappings
    took at import) record the process group of every call; returns the list they append to."""
    import megatron.core.distributed.param_and_grad_buffer as buffers
    import megatron.core.tensor_parallel.mappings as mappings
    import torch.distributed as dist

    seen: list = []

    def wrap(fn):
        def recorded(*args, **kw):
            group = kw.get("group", next((a for a in args if isinstance(a, dist.ProcessGroup)), None))
            seen.append(group if group is not None else dist.group.WORLD)
            return fn(*args, **kw)
        return recorded

    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "broadcast",
                 "all_gather", "reduce_scatter", "_all_gather_base", "_reduce_scatter_base"):
        setattr(dist, name, wrap(getattr(dist, name)))
    for module in (buffers, mappings):
        for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
            if hasattr(module, name):
                setattr(module, name, wrap(getattr(module, name)))
    return seen


def _group_names(groups: list) -> list:
    """Megatron's name for each group (the planner's words), or its ranks when it is none of them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    names: dict = {}
    for key, group in (("tensor-parallel", ps.get_tensor_model_parallel_group()),
                       ("data-parallel with CP", ps.get_data_parallel_group(with_context_parallel=True)),
                       ("data-parallel", ps.get_data_parallel_group()),
                       ("distributed-optimizer instance", ps.get_intra_distributed_optimizer_instance_group()),
                       ("model-parallel", ps.get_model_parallel_group()),
                       ("default (world)", dist.group.WORLD),
                       ("TP x CP", ps.get_tensor_and_context_parallel_group()),
                       ("expert-parallel", ps.get_expert_model_parallel_group()),
                       ("expert-tensor-parallel", ps.get_expert_tensor_parallel_group()),
                       ("expert-TP x EP", ps.get_expert_tensor_and_model_parallel_group()),
                       ("expert-data-parallel", ps.get_expert_data_parallel_group())):
        names.setdefault(id(group), key)
    return sorted({names.get(id(g), f"unknown {dist.get_process_group_ranks(g)}") for g in groups})


def test_critic_count_equals_the_built_critic(megatron_world):
    from megatron_searchr1.models.critic import build_critic_model

    counts = plan.count_params(plan.read_dims_of(TINY), tp=1, pp=1)
    critic = build_critic_model(TINY)
    assert counts.stages[0].critic == sum(p.numel() for p in critic.parameters())


def test_tp_shards_follow_the_split_rules(megatron_world):
    """Per-rank counts at TP = 2 by hand: linears halve, norms stay whole, the vocab pads to a multiple of 128 x 2."""
    dims = plan.read_dims_of(TINY)
    h, f, d = 32, 64, 8
    qkv = (4 + 2 * 2) * d * h + (4 + 2 * 2) * d  # weight + bias (Qwen2)
    layer = qkv // 2 + h * h // 2 + 2 * f * h // 2 + f * h // 2 + 2 * h
    vocab = 512 // 2 * h * 2  # 300 padded to a multiple of 128 x 2 = 512, embedding and output layer
    assert plan.count_params(dims, tp=2, pp=1).stages[0].actor == 2 * layer + vocab + h


LEAK_CHECK = """
import json, os, sys
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron_searchr1 import plan
counts = plan.count_params(plan.read_dims_of(json.loads(sys.argv[1])), tp=1, pp=2)
print(json.dumps([len(counts.stages), dist.is_initialized(), ps.model_parallel_is_initialized(),
                  sorted(k for k in ("RANK", "WORLD_SIZE", "MASTER_PORT") if k in os.environ)]))
"""


def test_counting_leaves_no_process_group_behind():
    """With no world running, count_params starts a world of one for the meta build and tears it down: the next
    test (or tool) finds no process group, no parallel state and no rendezvous variables."""
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", LEAK_CHECK, json.dumps(TINY)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**env, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [2, False, False, []]


# ---- formulas, by hand ---------------------------------------------------------------------------------------
def test_activation_and_head_bytes_by_hand():
    import json

    with open(os.path.join(CONFIGS, "Qwen2.5-7B-Instruct.json")) as f:
        dims = plan.read_dims_of(json.load(f))
    # h 3584, 28 heads of 128, 4 KV heads, F 18944, TP 4: 4h/4 + (7 + 2) 128 + 7 128 + 3 F / 4 elements of 2 bytes
    assert plan.activation_bytes_per_token_layer(dims, 4, sequence_parallel=True, recompute="selective",
                                                 a_bytes=2) == 2 * (3584 + 1152 + 896 + 14208)
    assert plan.activation_bytes_per_token_layer(dims, 4, sequence_parallel=False, recompute="none",
                                                 a_bytes=2) == 2 * (4 * 3584 + 1152 + 896 + 14208)
    assert plan.activation_bytes_per_token_layer(dims, 4, sequence_parallel=True, recompute="full",
                                                 a_bytes=2) == 2 * 3584 // 4
    assert plan.head_bytes_per_token(dims, 4, entropy=False) == 152064 // 4 * 12
    assert plan.head_bytes_per_token(dims, 4, entropy=True) == 152064 // 4 * 24


def test_moe_activation_bytes_by_hand():
    import json

    with open(os.path.join(CONFIGS, "Qwen3-30B-A3B.json")) as f:
        dims = plan.read_dims_of(json.load(f))
    # h 2048, 32 heads of 128, 4 KV heads, TP 4 with SP: 4h/4 + (8 + 2) 128 + 8 128, then per routed copy (top-8)
    # the permuted input and the expert output (2h) and 3 fm / 4 of the 768-wide expert; fp32 router logits + probs
    assert plan.activation_bytes_per_token_layer(dims, 4, sequence_parallel=True, recompute="selective",
                                                 a_bytes=2) == 2 * (2048 + 1280 + 1024 + 8 * (4096 + 576)) + 8 * 128


# ---- the shipped recipes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["grpo_qwen2.5-7b", "ppo_qwen2.5-7b", "grpo_qwen2.5-3b", "ppo_qwen2.5-3b"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_shipped_recipes_fit_on_80gb(megatron_world, name, nodes):
    cfg, hf = recipe(name, nodes=nodes)
    assert cfg.parallel.sequence_parallel and cfg.model.recompute == "selective" and cfg.rollout.sleep_level == 2
    result, _, _ = plan.plan_config(cfg, hf, nodes=nodes)
    assert result.fits, [(p.name, p.total / plan.GiB) for p in result.phases]
    # NCCL, vLLM's residue and the usable size are counted now; what is left covers fragmentation
    assert all(p.total <= result.gpu_bytes - 2 * plan.GiB for p in result.phases), \
        [(p.name, (result.gpu_bytes - p.total) / plan.GiB) for p in result.phases]
    assert result.host_bytes_per_node == 0 or cfg.model.grad_offload  # sleep level 2: no pinned vLLM copy


@pytest.mark.parametrize("name", ["grpo_llds_qwen2.5-3b", "dapo_qwen2.5-3b", "gspo_qwen2.5-3b"])
def test_toolkit_recipes_fit_on_one_node(megatron_world, name):
    """The RL toolkit's recipes (LLDS, DAPO, GSPO on Qwen2.5-3B) fit one 8 x 80 GiB node in every phase, with room
    for fragmentation."""
    cfg, hf = recipe(name, nodes=1)
    result, _, _ = plan.plan_config(cfg, hf, nodes=1)
    assert result.fits and all(p.total <= result.gpu_bytes - 2 * plan.GiB for p in result.phases), \
        [(p.name, (result.gpu_bytes - p.total) / plan.GiB) for p in result.phases]


@pytest.mark.slow
def test_30b_a3b_recipe_fits_with_margin_and_counts_the_reference_in_the_update(megatron_world):
    """The MoE recipe at TP 4 x EP 4 (expert-TP = TP, Megatron's default) with full recomputation fits two 8 x 80
    GiB nodes with >= 4 GiB free in every phase. ref_offload frees the reference only while the engine runs:
    reload() brings it back before the log-prob passes, so it is in the update peak. At selective recomputation
    (the layout that dropped it) the update peak is over and the planner names full recomputation."""
    cfg, hf = recipe("grpo_qwen3-30b-a3b", nodes=2)
    assert cfg.parallel.sequence_parallel and cfg.model.ref_offload and cfg.rollout.sleep_level == 2
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.model.recompute) == (4, 4, "full")
    result, counts, _ = plan.plan_config(cfg, hf, nodes=2)
    assert result.fits and all(p.total <= result.gpu_bytes - 4 * plan.GiB for p in result.phases), \
        [(p.name, (result.gpu_bytes - p.total) / plan.GiB) for p in result.phases]
    st = counts.stages[0]
    # 48 layers x 128 experts x (2 x 768 x 2048 fc1 + 2048 x 768 fc2) = 28,991,029,248 expert params, over EP 4 x TP 4
    assert st.actor_experts == 28_991_029_248 // 16
    update, rollout = result.phase("update peak"), result.phase("rollout")
    assert update.items["reference weights"] == st.actor * 2 and rollout.items["reference weights"] == 0
    assert update.items["actor optimizer"] > st.actor_experts * 12  # expert-DP 1: the experts' state unsharded
    assert update.items["NCCL (trainer groups)"] >= 8 * plan.NCCL_GROUP_BYTES  # TP, DP x 2, MP, world, EP groups
    old, _, fix = plan.plan_config(plan.with_overrides(cfg, {"model.recompute": "selective"}), hf, nodes=2)
    assert not old.fits and old.worst.name == "update peak" and fix == {"model.recompute": "full"}


@pytest.mark.slow
def test_the_recipe_table_is_the_planners(megatron_world):
    """examples/planner.md's table of the shipped recipes is what `--summary` prints for each row's recipe."""
    with open(os.path.join(REPO, "examples", "planner.md")) as f:
        rows = [line.strip() for line in f if line.startswith("| ") and line.split("|")[1].strip().endswith(".yaml")]
    assert len(rows) == 10
    for row in rows:
        name, nodes = (cell.strip() for cell in row.split("|")[1:3])
        cfg, hf = recipe(name.removesuffix(".yaml"), nodes=int(nodes))
        result, counts, _ = plan.plan_config(cfg, hf, nodes=int(nodes))
        assert plan.summary_row(result, cfg, counts, name, int(nodes)) == row


def test_a_config_over_the_limit_gets_a_knob_that_fits(megatron_world):
    cfg, hf = recipe("ppo_qwen2.5-3b", ["optim.max_tokens_per_micro_batch=16384"])
    result, counts, fix = plan.plan_config(cfg, hf, nodes=1)
    assert not result.fits and fix
    fixed, _, _ = plan.plan_config(plan.with_overrides(cfg, fix), hf, nodes=1)
    assert fixed.fits


def test_kv_cache_and_vllm_weights_against_vllm_and_a_hand_count(megatron_world):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cfg, hf = recipe("grpo_qwen2.5-7b")  # engine_tp 1: one engine per GPU, all 4 KV heads on it
    result, _, _ = plan.plan_config(cfg, hf, nodes=1)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)  # vLLM's own count
    assert result.kv_bytes_per_token == 28 * spec.page_size_bytes // 16
    # Qwen2.5-7B by hand: embedding and output layer 2 x 152064 x 3584 = 1,089,994,752; per layer q 3584 x 3584 +
    # 3584, k and v 2 x (3584 x 512 + 512), o 3584 x 3584, gate/up 2 x 3584 x 18944, down 18944 x 3584, two norms
    # 2 x 3584: 233,057,792, x 28 = 6,525,618,176; final norm 3584: 7,615,616,512 params, bf16 in the engine
    assert result.phase("rollout").items["vLLM weights"] == 7_615_616_512 * 2
    assert result.full_length == 4096 + 4096
    assert result.trajectories_per_engine == 320  # 512 prompts x 5 samples over 8 engines
    assert result.kv_tokens * result.kv_bytes_per_token <= result.kv_bytes < (result.kv_tokens + 1) * \
        result.kv_bytes_per_token


def test_vllm_batch_defaults_are_vllms():
    """vLLM's own rule (EngineArgs.get_batch_defaults) asked as if it ran on each GPU: the planner's table agrees."""
    from unittest import mock

    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    for name, gib in (("NVIDIA H100 80GB HBM3", 79.1), ("NVIDIA A100-SXM4-80GB", 79.3), ("NVIDIA H200", 139.8),
                      ("NVIDIA L40S", 44.4), ("NVIDIA B200", 178.4)):
        with mock.patch.object(current_platform, "get_device_total_memory", return_value=int(gib * plan.GiB)), \
                mock.patch.object(current_platform, "get_device_name", return_value=name), \
                mock.patch.object(current_platform, "is_cpu", return_value=False):
            tokens, seqs = EngineArgs.get_batch_defaults(1)
        want = (tokens[UsageContext.LLM_CLASS], seqs[UsageContext.LLM_CLASS])
        assert plan.vllm_batch_defaults(int(gib * plan.GiB), name) == want, name


def test_no_room_for_a_kv_cache_does_not_fit(megatron_world):
    cfg, hf = recipe("grpo_qwen2.5-7b", ["rollout.gpu_memory_utilization=0.2"])  # 16 GiB < 14.2 weights + the rest
    result, counts, fix = plan.plan_config(cfg, hf, nodes=1)
    assert result.kv_bytes <= 0 and not result.fits
    assert "verdict: does NOT fit; vLLM has no room for its KV cache" in plan.render(result, cfg, counts, fix, 80)


def test_offload_and_sleep_level_move_bytes_to_the_host(megatron_world):
    cfg, hf = recipe("grpo_qwen2.5-7b", ["rollout.sleep_level=1", "model.grad_offload=false",
                                         "model.optimizer_offload=false"])
    level1, _, _ = plan.plan_config(cfg, hf, nodes=1)
    roll = level1.phase("rollout")
    assert level1.host_bytes_per_node == 8 * roll.items["vLLM weights"]  # pinned copy per GPU
    cfg2, _ = recipe("grpo_qwen2.5-7b")
    level2, _, _ = plan.plan_config(cfg2, hf, nodes=1)
    roll2, update2 = level2.phase("rollout"), level2.phase("update peak")
    assert roll2.items["actor gradients (fp32)"] == 0 and roll2.items["actor optimizer"] == 0
    assert roll.items["actor gradients (fp32)"] > 0
    assert level2.host_bytes_per_node == 8 * (update2.items["actor gradients (fp32)"]
                                              + update2.items["actor optimizer"])


# ---- disaggregated placement: trainer ranks and rollout ranks ----------------------------------------------------
def test_the_async_recipe_plans_each_kind_of_rank(megatron_world):
    """examples/grpo_qwen2.5-7b_async.yaml on 2 nodes: 8 trainer ranks at TP 4 x DP 2 hold the actor, its gradients,
    its whole optimizer state and the reference in every phase (no engine: nothing offloads) and no vLLM row; the 8
    rollout ranks hold vLLM's share (weights, activations, residue, KV cache) and no trainer state; both fit."""
    cfg, hf = recipe("grpo_qwen2.5-7b_async", nodes=2)
    p, r = cfg.parallel, cfg.rollout
    assert (p.rollout_placement, p.rollout_ranks, r.max_staleness, r.engine_tp) == ("disaggregated", 8, 1, 1)
    assert cfg.algo.rollout_correction != "none"
    result, counts, fix = plan.plan_config(cfg, hf, nodes=2)
    assert result.fits and fix is None and result.roles == ["trainer", "rollout"]
    assert result.dp == 2 and result.rollout_ranks == 8
    trainer = {ph.name: ph for ph in result.phases if ph.role == "trainer"}
    rollout = {ph.name: ph for ph in result.phases if ph.role == "rollout"}
    assert list(trainer) == ["start-up", "weight sync", "log-prob passes", "update peak"]
    assert list(rollout) == ["start-up", "weight sync", "rollout"]
    st = counts.stages[0]
    for ph in ("weight sync", "log-prob passes", "update peak"):
        items = trainer[ph].items
        assert items["actor gradients (fp32)"] == st.actor * 4 and items["reference weights"] == st.actor * 2
        assert items["actor optimizer"] == st.actor * 12 // 2  # Adam + fp32 master, sharded over DP 2
        assert not any(k.startswith("vLLM") for k in items)
    assert trainer["weight sync"].items["sync buckets"] == result.sync_extra_bytes > 0
    share = int(r.gpu_memory_utilization * result.gpu_bytes)
    gen = rollout["rollout"].items
    assert not set(gen) & set(plan.STATE_KINDS) and rollout["rollout"].total == plan.CUDA_CONTEXT + share
    assert gen["vLLM KV cache"] == result.kv_bytes > 30 * plan.GiB
    assert rollout["weight sync"].total == rollout["rollout"].total + (r.sync_bucket_mb << 20)
    # Megatron's groups span the trainer ranks only: its world is 8, not 16
    assert dict((name.split(":")[0], size) for name, size in result.nccl)["default (world)"] == 8
    # the phase of a name is the larger of the two kinds' (the summary row's columns)
    assert result.phase("start-up") is rollout["start-up"] and result.phase("update peak") is trainer["update peak"]
    row = plan.summary_row(result, cfg, counts, "grpo_qwen2.5-7b_async.yaml", 2)
    assert "| 4x1x2 + 8 rollout |" in row and row.endswith("| fits |")
    # the colocated recipe on the same 16 GPUs offloads the optimizer while vLLM generates; this one never does
    colo, _, _ = plan.plan_config(*recipe("grpo_qwen2.5-7b", nodes=2), nodes=2)
    assert colo.phase("weight sync").items["actor optimizer"] == 0 < trainer["weight sync"].items["actor optimizer"]


def test_disaggregated_refusals_and_knobs(megatron_world):
    """A world with no trainer rank left is one error naming the fields; a trainer over the limit gets a knob that
    acts on a trainer rank (never an offload or sleep knob: nothing offloads there)."""
    with pytest.raises(UsageError, match="parallel.rollout_ranks=8 leaves no trainer rank in a world of 8"):
        recipe("grpo_qwen2.5-7b_async", nodes=1)
    cfg, hf = recipe("grpo_qwen2.5-7b_async", ["optim.max_tokens_per_micro_batch=65536", "model.recompute=none"],
                     nodes=2)
    result, counts, fix = plan.plan_config(cfg, hf, nodes=2)
    assert not result.fits and result.worst.role == "trainer" and result.worst.name == "update peak"
    assert fix and not any("offload" in k or "sleep" in k for k in fix), fix
    assert plan.plan_memory(plan.with_overrides(cfg, fix), counts, world=16, gpu_bytes=result.gpu_bytes).fits


def test_cli_prints_the_table_and_verdict(megatron_world, capsys):
    assert plan.main([os.path.join(REPO, "examples", "grpo_qwen2.5-3b.yaml"), "--model-config",
                      os.path.join(CONFIGS, "Qwen2.5-3B-Instruct.json")]) == 0
    out = capsys.readouterr().out
    for word in ("update peak", "log-prob passes", "rollout", "actor gradients (fp32)", "NCCL (trainer groups)",
                 "KV cache:", "verdict: fits"):
        assert word in out


# ---- command-line errors: one line, exit 2, before the heavy imports -----------------------------------------
# `python -m megatron_searchr1.plan ARGS` with torch made unimportable (None in sys.modules: `import torch` raises):
# an error path that reaches for torch ends in an ImportError traceback, not its `error:` line
NO_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['plan', *sys.argv[1:]]; "
            "runpy.run_module('megatron_searchr1.plan', run_name='__main__', alter_sys=True)")


def _run(*args, block_torch=False):
    start = time.time()
    cmd = [sys.executable, "-c", NO_TORCH] if block_torch else [sys.executable, "-m", "megatron_searchr1.plan"]
    proc = subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
    return proc, time.time() - start


@pytest.mark.parametrize("args,message", [
    (["missing.yaml"], "error: config 'missing.yaml' does not exist"),
    (["examples/grpo_qwen2.5-7b.yaml", "rollout.nn=3"], "error: unknown field rollout.nn (did you mean rollout.n?)"),
    (["examples/grpo_qwen2.5-7b.yaml"], "error: model config 'models/Qwen2.5-7B-Instruct/config.json' does not "
                                        "exist"),
    (["examples/grpo_qwen2.5-7b.yaml", "--gpus-per-node", "2"], "error: world size 2 is not a multiple of "
                                                                "parallel.tp * parallel.pp = 4"),
    (["examples/grpo_qwen2.5-7b.yaml", "--nodes", "0"], "error: argument --nodes: must be >= 1, got 0"),
])
def test_cli_errors_are_one_line_and_fast_and_need_no_torch(args, message):
    proc, seconds = _run(*args, block_torch=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert seconds < 10


def test_the_missing_config_message_names_files_that_open():
    """The files the error message offers are the shipped ones: each opens as a config.json of its model, and the
    folder holds no config the message leaves out."""
    import json
    import re

    proc, _ = _run("examples/grpo_qwen2.5-7b.yaml", block_torch=True)
    assert proc.returncode == 2, proc.stderr
    named = re.findall(r"[\w.-]+\.json", proc.stderr.split(" holds ", 1)[1])
    assert sorted(named) == sorted(f for f in os.listdir(CONFIGS) if f.endswith(".json")), proc.stderr
    for name in named:
        with open(os.path.join(CONFIGS, name)) as f:
            hf = json.load(f)
        assert hf["architectures"][0].endswith("ForCausalLM") and hf["num_hidden_layers"] > 0, name


def test_the_torch_block_bites():
    """The block above is real: a config that gets past every check needs torch, and fails without it."""
    proc, _ = _run("examples/grpo_qwen2.5-3b.yaml", "--model-config", "tests/models/real_configs/"
                   "Qwen2.5-3B-Instruct.json", block_torch=True)
    assert proc.returncode != 0 and "torch" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]


def test_cli_error_for_a_tp_that_does_not_divide_the_heads(megatron_world):
    cfg, hf = recipe("grpo_qwen2.5-7b", ["parallel.tp=8"])  # 28 heads
    with pytest.raises(UsageError, match="TP=8 does not divide num_attention_heads=28.*parallel.tp"):
        plan.plan_config(cfg, hf, nodes=1)


def test_help_shows_defaults():
    proc, _ = _run("--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())  # argparse wraps long lines
    assert "issue" not in text.lower()  # what the options do, not the project's history
    for part in ("--gpus-per-node", "(default: 8)", "(default: 80.0)", "(default: H100)"):
        assert part in text


if __name__ == "__main__":  # the EP = 2 worker of test_moe_bytes_equal_torch_at_ep2 (torchrun, 2 ranks, gloo)
    import json

    # run as a script, tests/ heads sys.path and its megatron/ test package would shadow megatron-core
    sys.path.remove(os.path.dirname(os.path.abspath(__file__)))
    import torch.distributed as dist

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.families import is_expert_param

    initialize_megatron(tp=1, pp=1, ep=2, device="cpu")
    seen = _record_collective_groups()
    weights, grads, _, optimizer = _allocated(TINY_MOE, torch.bfloat16, True)
    groups = _group_names(seen)
    from megatron_searchr1.trainer.roles import build_actor

    bare = build_actor(TINY_MOE, params_dtype=torch.bfloat16).module
    params = sum(p.numel() for p in bare.parameters())
    experts = sum(p.numel() for n, p in bare.named_parameters() if is_expert_param(n))
    print("RESULT " + json.dumps(dict(weights=weights, grads=grads, optimizer=optimizer, params=params,
                                          experts=experts, groups=groups)), flush=True)
    dist.barrier()
