"""megatron_searchr1/plan.py: byte counts against what torch allocates for tiny models, the shipped recipes' verdicts,
the formulas against hand-computed values, and the command line's one-line errors."""
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


@pytest.mark.slow
def test_moe_bytes_equal_torch_at_ep2(megatron_world):
    """Two ranks at EP = 2 (torchrun, gloo), this file as the worker: each holds 2 of the 4 experts and the whole
    dense part; with the distributed optimizer the dense state is sharded over DP = 2 and the experts' over
    expert-DP = 1, which is the plan's optimizer shard summed over the two ranks."""
    import json

    from tests.dist_utils import run_torchrun

    out = run_torchrun(__file__, 2, timeout=600)
    ranks = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("PLAN_BYTES ")]
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
    planned = next(p for p in result.phases if p.name == "update peak").items["optimizer shard"]
    assert sum(r["optimizer"] for r in ranks) == 2 * planned


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
# What examples/grpo_qwen2.5-7b.yaml said before issue 19's memory settings.
BEFORE = ["parallel.sequence_parallel=false", "model.recompute=none", "model.grad_offload=false",
          "model.optimizer_offload=false", "rollout.gpu_memory_utilization=0.4"]


def test_7b_grpo_as_before_does_not_fit_at_wake_up(megatron_world):
    """The recipe as it was, with the trainer as it was (vLLM's weights and KV cache woken together while PyTorch
    still caches the update's activations): ~90 GiB at the weight sync on an 80 GiB GPU, TP 4 x DP 2."""
    cfg, hf = recipe("grpo_qwen2.5-7b", BEFORE)
    assert (cfg.parallel.tp, cfg.parallel.pp) == (4, 1)
    result, counts, fix = plan.plan_config(cfg, hf, nodes=1, wake="together")
    assert result.dp == 2 and not result.fits
    sync = next(p for p in result.phases if p.name == "weight sync")
    assert sync.total > 85 * plan.GiB
    assert sync.items["PyTorch cache (update)"] > 25 * plan.GiB
    assert next(p for p in result.phases if p.name == "update peak").total < 80 * plan.GiB  # training itself fits
    text = plan.render(result, cfg, counts, fix, "together")
    assert "verdict: does NOT fit; weight sync needs" in text


@pytest.mark.parametrize("name", ["grpo_qwen2.5-7b", "ppo_qwen2.5-7b", "grpo_qwen2.5-3b", "ppo_qwen2.5-3b"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_shipped_recipes_fit_on_80gb(megatron_world, name, nodes):
    cfg, hf = recipe(name, nodes=nodes)
    assert cfg.parallel.sequence_parallel and cfg.model.recompute == "selective" and cfg.rollout.sleep_level == 2
    result, _, _ = plan.plan_config(cfg, hf, nodes=nodes)
    assert result.fits, [(p.name, p.total / plan.GiB) for p in result.phases]
    assert all(p.total <= 76 * plan.GiB for p in result.phases)  # >= 4 GiB margin for what the estimate misses
    assert result.host_bytes_per_node == 0 or cfg.model.grad_offload  # sleep level 2: no pinned vLLM copy


@pytest.mark.slow
def test_30b_a3b_recipe_fits_and_tp2_ep8_does_not(megatron_world):
    """The MoE recipe at its TP 4 x EP 4 layout fits two 8 x 80 GiB nodes; TP 2 x EP 8 (engine_tp <= 2) is over at
    the update peak (top-8 routed activations at TP 2) and the planner names full recomputation."""
    cfg, hf = recipe("grpo_qwen3-30b-a3b", nodes=2)
    assert cfg.parallel.sequence_parallel and cfg.model.recompute == "selective" and cfg.rollout.sleep_level == 2
    assert (cfg.parallel.tp, cfg.parallel.ep) == (4, 4)
    result, counts, _ = plan.plan_config(cfg, hf, nodes=2)
    assert result.fits and all(p.total <= 76 * plan.GiB for p in result.phases), \
        [(p.name, p.total / plan.GiB) for p in result.phases]
    st = counts.stages[0]
    assert 29e9 / 16 * 0.99 < st.actor_experts < 29e9 / 16 * 1.01  # 128 x 48 experts of 3 x 2048 x 768, over 16
    update = next(p for p in result.phases if p.name == "update peak")
    assert update.items["optimizer shard"] > st.actor_experts * 12  # expert-DP 1: the experts' state unsharded
    cfg2, _ = recipe("grpo_qwen3-30b-a3b", ["parallel.tp=2", "parallel.ep=8", "rollout.engine_tp=2"], nodes=2)
    result2, _, fix = plan.plan_config(cfg2, hf, nodes=2)
    assert not result2.fits and result2.worst.name == "update peak" and fix == {"model.recompute": "full"}


def test_ppo_3b_before_did_not_fit_and_the_planner_names_a_knob(megatron_world):
    cfg, hf = recipe("ppo_qwen2.5-3b", ["optim.max_tokens_per_micro_batch=16384"])
    result, counts, fix = plan.plan_config(cfg, hf, nodes=1)
    assert not result.fits and fix
    fixed, _, _ = plan.plan_config(plan._with(cfg, fix), hf, nodes=1)
    assert fixed.fits


def test_kv_cache_arithmetic(megatron_world):
    cfg, hf = recipe("grpo_qwen2.5-7b")
    result, _, _ = plan.plan_config(cfg, hf, nodes=1)
    assert result.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # k and v, 28 layers, 4 KV heads of 128, bf16
    assert result.kv_tokens == result.kv_bytes // result.kv_bytes_per_token
    assert result.full_length == 4096 + 4096
    assert result.trajectories_per_engine == 512 * 5 // 8  # engine_tp 1: one engine per GPU
    roll = next(p for p in result.phases if p.name == "rollout")
    assert roll.items["vLLM weights"] + roll.items["vLLM activations"] + roll.items["vLLM KV cache"] \
        + plan.VLLM_OUTSIDE_POOLS == int(0.6 * 80 * plan.GiB)


def test_no_room_for_a_kv_cache_does_not_fit(megatron_world):
    cfg, hf = recipe("grpo_qwen2.5-7b", ["rollout.gpu_memory_utilization=0.2"])  # 16 GiB < 14.2 weights + the rest
    result, counts, fix = plan.plan_config(cfg, hf, nodes=1)
    assert result.kv_bytes <= 0 and not result.fits
    assert "verdict: does NOT fit; vLLM has no room for its KV cache" in plan.render(result, cfg, counts, fix, "staged")


def test_offload_and_sleep_level_move_bytes_to_the_host(megatron_world):
    cfg, hf = recipe("grpo_qwen2.5-7b", ["rollout.sleep_level=1", "model.grad_offload=false",
                                         "model.optimizer_offload=false"])
    level1, _, _ = plan.plan_config(cfg, hf, nodes=1)
    roll = next(p for p in level1.phases if p.name == "rollout")
    assert level1.host_bytes_per_node == 8 * roll.items["vLLM weights"]  # pinned copy per GPU
    cfg2, _ = recipe("grpo_qwen2.5-7b")
    level2, _, _ = plan.plan_config(cfg2, hf, nodes=1)
    roll2 = next(p for p in level2.phases if p.name == "rollout")
    assert roll2.items["gradient buffer (fp32)"] == 0 and roll2.items["optimizer shard"] == 0
    assert roll.items["gradient buffer (fp32)"] > 0
    assert level2.host_bytes_per_node == 8 * (roll.items["gradient buffer (fp32)"] + roll.items["optimizer shard"])


def test_cli_prints_the_table_and_verdict(megatron_world, capsys):
    assert plan.main([os.path.join(REPO, "examples", "grpo_qwen2.5-3b.yaml"), "--model-config",
                      os.path.join(CONFIGS, "Qwen2.5-3B-Instruct.json")]) == 0
    out = capsys.readouterr().out
    for word in ("update peak", "weight sync", "rollout", "gradient buffer (fp32)", "KV cache:", "verdict: fits"):
        assert word in out


# ---- command-line errors: one line, exit 2, before the heavy imports -----------------------------------------
def _run(*args):
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
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
def test_cli_errors_are_one_line_and_fast(args, message):
    proc, seconds = _run(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert "import torch" not in proc.stderr and seconds < 10


def test_cli_error_for_a_tp_that_does_not_divide_the_heads(megatron_world):
    cfg, hf = recipe("grpo_qwen2.5-7b", ["parallel.tp=8"])  # 28 heads
    with pytest.raises(UsageError, match="TP=8 does not divide num_attention_heads=28.*parallel.tp"):
        plan.plan_config(cfg, hf, nodes=1)


def test_help_shows_defaults():
    proc, _ = _run("--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())  # argparse wraps long lines
    for part in ("--gpus-per-node", "(default: 8)", "(default: 80.0)", "(default: staged)"):
        assert part in text


if __name__ == "__main__":  # the EP = 2 worker of test_moe_bytes_equal_torch_at_ep2 (torchrun, 2 ranks, gloo)
    import json

    # run as a script, tests/ heads sys.path and its megatron/ test package would shadow megatron-core
    sys.path.remove(os.path.dirname(os.path.abspath(__file__)))
    import torch.distributed as dist

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.models.families import is_expert_param

    initialize_megatron(tp=1, pp=1, ep=2, device="cpu")
    weights, grads, _, optimizer = _allocated(TINY_MOE, torch.bfloat16, True)
    from megatron_searchr1.trainer.roles import build_actor

    bare = build_actor(TINY_MOE, params_dtype=torch.bfloat16).module
    params = sum(p.numel() for p in bare.parameters())
    experts = sum(p.numel() for n, p in bare.named_parameters() if is_expert_param(n))
    print("PLAN_BYTES " + json.dumps(dict(weights=weights, grads=grads, optimizer=optimizer, params=params,
                                          experts=experts)), flush=True)
    dist.barrier()
