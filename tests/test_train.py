"""The RL trainer (megatron_searchr1/train.py) and the SFT stage (sft.py), end to end with real processes.

Quick: bad configs fail with one `error:` line, exit 2, in seconds (no model is built), and the per-data-source
reward table. Slow (--runslow): on one synthetic world, tiny model and live BM25 server (tests/rl_fixtures.py),
  - SFT at TP=2 for 10 steps (loss falls, checkpoint + HF export; the RL runs below start from it);
  - GRPO at TP=2 for 3 steps with vLLM rollouts: TensorBoard scalars, checkpoints, engine-vs-trainer log-prob
    gap, and the HF export gives the checkpoint's logits in transformers (one vLLM engine split over two ranks,
    rollout.engine_tp=2, is checked by tests/test_layout_sweep.py and, through this entry point, by
    tests/test_train_failures.py);
  - tools/evaluate.py on a model that gives one answer to every question (EM strictly between 0 and 1);
  - PPO with a critic (GAE, KL in the reward) at PP=2 for 3 steps.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from megatron_searchr1.reward.qa_em import em_check, extract_solution
from megatron_searchr1.trainer.reports import reward_table
from tests.dist_utils import REPO
from tests.rl_fixtures import (  # noqa: F401 (fixtures)
    child_env, grpo_run, rl_root, run_module, server, tiny_model, world,
)


# ------------------------------------------------------------------------------------------------ quick tests
def test_reward_table_per_data_source():
    t = reward_table([("nq", 1.0, 1.0), ("nq", 0.5, 0.0), ("hotpotqa", 0.0, 0.0), ("hotpotqa", 1.0, 1.0)])
    assert t["reward/mean"] == 0.625 and t["reward/em"] == 0.5
    assert t["reward/nq/mean"] == 0.75 and t["reward/nq/em"] == 0.5
    assert t["reward/hotpotqa/mean"] == 0.5 and t["reward/hotpotqa/em"] == 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """A model dir with only config.json (3 heads, 2 layers) and data files that exist: enough for validation."""
    d = tmp_path_factory.mktemp("badcfg")
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps({"num_attention_heads": 3, "num_hidden_layers": 2}))
    from megatron_searchr1.data.qa import make_row, write_rows

    for name in ("train.parquet", "val.parquet"):  # real one-row files: the data check reads their footers
        write_rows([make_row("who founded acme", ["Bo"], "nq", "train", 0, uid="nq-train-0")], str(d / name))
    return d


BAD_CONFIGS = {
    "tp_heads": (["parallel.tp=2"], {"WORLD_SIZE": "2"}, "does not divide the model's num_attention_heads=3"),
    "estimator": (["algo.adv_estimator=ppo"], {}, "algo.adv_estimator must be one of"),
    "grpo_n1": (["rollout.n=1"], {}, "set rollout.n >= 2"),
    "missing_file": (["data.train_files=[/nonexistent/train.parquet]"], {}, "does not exist"),
    "unknown_field": (["rollout.max_turn=2"], {}, "did you mean rollout.max_turns"),
    "no_server": ([], {}, "does not answer"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_fails_fast_with_one_error_line(fake_run, case):
    overrides, env, expected = BAD_CONFIGS[case]
    args = [f"model.path={fake_run / 'model'}", f"data.train_files=[{fake_run / 'train.parquet'}]",
            f"data.val_files=[{fake_run / 'val.parquet'}]", f"retrieval.url=http://127.0.0.1:{_free_port()}",
            f"trainer.output_dir={fake_run / 'out'}", *overrides]
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.train", *args], cwd=REPO, capture_output=True,
                          text=True, env=child_env(**env), timeout=60)
    elapsed = time.time() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert expected in lines[0]
    assert elapsed < 10, f"took {elapsed:.1f}s: the config must be checked before heavy work"
    assert not (fake_run / "out").exists()  # nothing was started


# ------------------------------------------------------------------------------------------------ slow runs
SCALARS = [  # what every RL run must log
    "reward/mean", "reward/em", "rollout/response_length_mean", "rollout/turns_mean", "rollout/searches_mean",
    "rollout/finish_answer", "rollout/finish_length", "rollout/finish_max_turns", "rollout/finish_invalid",
    "rollout/valid_action_ratio", "actor/entropy", "actor/pg_clipfrac", "actor/grad_norm", "actor/pg_loss",
    "train/lr", "time/step", "time/rollout", "time/sync", "time/old_log_probs", "time/update",
    "perf/response_tokens_per_s", "train/logprob_gap_engine",
]
STEP_FIELDS_THAT_VARY = ("time/", "perf/", "sync/bytes_per_s", "sync/seconds", "rollout/computed_tokens")


def rl_args(world_dir: str, model_dir: str, url: str, out: str, *extra: str) -> list[str]:
    """A tiny GRPO config at TP=2 (examples/grpo_tiny_cpu.yaml made small enough for a test)."""
    return [os.path.join(REPO, "examples", "grpo_tiny_cpu.yaml"), f"model.path={model_dir}", "model.megatron_ckpt=null",
            f"retrieval.url={url}", f"data.train_files=[{world_dir}/train.parquet]",
            f"data.val_files=[{world_dir}/validation.parquet]", "data.val_max_samples=4", "data.train_batch_size=4",
            # one mini-batch: on-policy (the update's own forward gives the old log-probs; the PP=2 run below, with
            # KL in the reward, takes the separate pass), with top-k/top-p off so the engine log-probs are comparable
            "algo.ppo_mini_batch_size=4", "rollout.temperature=1.0", "rollout.n=2", "rollout.max_turns=2", "rollout.max_tokens_per_turn=24",
            "rollout.max_response_length=160", "rollout.max_obs_length=64", "rollout.kv_cache_gib=0.25",
            "trainer.save_freq=1", "trainer.val_before_train=false", "logging.progress_bar=false",
            # a random model earns no reward: the entropy bonus and a large LR make every step move the weights,
            # so later steps (and a resumed step) depend on the earlier updates
            "algo.use_kl_loss=true", "algo.entropy_coeff=0.01", "optim.lr=1e-3", f"trainer.output_dir={out}",
            *extra]


def step_metrics(out: str) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r for r in recs if "reward/mean" in r}


@pytest.fixture(scope="module")
def sft_run(world, tiny_model, rl_root):
    out = os.path.join(rl_root, "sft")
    run_module("megatron_searchr1.sft", [os.path.join(REPO, "examples", "sft_tiny_cpu.yaml"), f"model.path={tiny_model}",
                                        f"data.dataset_dir={world}/sft", f"trainer.output_dir={out}",
                                        "trainer.total_steps=10", "data.batch_size=8", "optim.lr=3e-3",
                                        "logging.progress_bar=false"], nproc=2)
    return out


@pytest.mark.slow
def test_sft_lowers_the_loss_and_the_rl_trainer_starts_from_it(sft_run, tiny_model):
    from megatron_searchr1.checkpoint import latest_step
    from megatron_searchr1.metrics import read_scalars
    from megatron_searchr1.trainer.sources import resolve_model_source

    loss = [v for _, v in read_scalars(os.path.join(sft_run, "tensorboard"))["sft/loss"]]
    assert len(loss) == 10
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.2, loss
    assert latest_step(os.path.join(sft_run, "checkpoints")) == 10
    actor = resolve_model_source(sft_run)
    assert actor == os.path.join(sft_run, "checkpoints", "step_000010", "actor")
    assert resolve_model_source(os.path.join(sft_run, "checkpoints", "step_000010")) == actor  # one step's dir
    assert os.path.isfile(os.path.join(actor, "metadata.json"))
    assert os.path.isfile(os.path.join(sft_run, "hf", "model.safetensors"))


@pytest.mark.slow
def test_grpo_tp2_logs_every_scalar_checkpoints_and_exports(grpo_run):
    from megatron_searchr1.checkpoint import latest_step
    from megatron_searchr1.metrics import read_scalars

    out, log = grpo_run
    scalars = read_scalars(os.path.join(out, "tensorboard"))
    missing = [k for k in SCALARS + ["actor/kl_loss"] if k not in scalars]
    assert not missing, missing
    assert any(re.fullmatch(r"reward/synthetic_\dhop/(mean|em)", k) for k in scalars), sorted(scalars)
    for key in SCALARS:
        assert [s for s, _ in scalars[key]] == [1, 2, 3], key
    finish = sum(scalars[f"rollout/finish_{r}"][0][1] for r in ("answer", "length", "max_turns", "invalid",
                                                                "search_error"))
    assert finish == pytest.approx(1.0)  # shares of all trajectories, not of one engine's
    # right after a weight sync (fp32 on both sides) the engine's log-probs are the trainer's
    assert all(v < 1e-3 for _, v in scalars["train/logprob_gap_engine"]), scalars["train/logprob_gap_engine"]
    assert all(v > 0 for _, v in scalars["actor/grad_norm"])
    assert scalars["train/lr"][0][1] == pytest.approx(1e-3)
    assert "val/all/em" in scalars  # the final validation
    assert latest_step(os.path.join(out, "checkpoints")) == 3
    assert os.path.isfile(os.path.join(out, "hf", "model.safetensors"))
    assert "exported the actor" in log
    # logging.plot: the reward / EM curves as pictures (plots.py; tests/test_plots.py checks what they show)
    assert all(os.path.getsize(os.path.join(out, f)) > 10_000 for f in ("training_reward.png", "validation_em.png"))


@pytest.mark.slow
def test_hf_export_gives_the_checkpoint_logits(grpo_run):
    out, _ = grpo_run
    # as a module from the repo root: run as a file, tests/megatron/ would shadow the megatron package
    proc = subprocess.run([sys.executable, "-m", "tests.hf_export_check_script",
                           os.path.join(out, "hf"), os.path.join(out, "checkpoints", "step_000003", "actor")],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"max_abs_diff=(\S+) max_abs_logit=(\S+)", proc.stdout)
    assert m, proc.stdout
    assert float(m.group(2)) > 0.1 and float(m.group(1)) < 1e-4


@pytest.mark.slow
def test_ppo_with_critic_pp2(world, sft_run, tiny_model, server, rl_root):
    """GAE with a critic, KL in the reward, PP=2, starting from the SFT checkpoint (model.megatron_ckpt)."""
    from megatron_searchr1.checkpoint import latest_step
    from megatron_searchr1.metrics import read_scalars

    out = os.path.join(rl_root, "ppo")
    args = rl_args(world, tiny_model, server, out, "trainer.total_steps=3", "parallel.tp=1", "parallel.pp=2",
                   f"model.megatron_ckpt={sft_run}", "algo.adv_estimator=gae", "algo.use_kl_loss=false",
                   "algo.use_kl_in_reward=true", "algo.kl_ctrl=adaptive", "algo.kl_coef=0.01", "optim.critic_lr=1e-3",
                   # the entropy bonus moves the actor at step 1 even with zero reward (as in the GRPO runs), so the
                   # policy leaves the reference and the KL penalty gives the critic returns to fit from step 2
                   "trainer.export_hf=false", "algo.entropy_coeff=0.01")
    run_module("megatron_searchr1.train", args, nproc=2)
    scalars = read_scalars(os.path.join(out, "tensorboard"))
    missing = [k for k in SCALARS + ["critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm",
                                     "actor/reward_kl_penalty", "actor/reward_kl_coef"] if k not in scalars]
    assert not missing, missing
    assert [s for s, _ in scalars["critic/vf_loss"]] == [1, 2, 3]
    # step 1: zero value head, zero reward, actor == reference (no KL penalty) -> returns == values == 0, no
    # gradient; from step 2 the KL penalty makes the returns non-zero
    assert all(v > 0 for _, v in scalars["critic/grad_norm"][1:]), scalars["critic/grad_norm"]
    assert all(v < 1e-3 for _, v in scalars["train/logprob_gap_engine"])
    assert scalars["actor/entropy"][0][1] > 0
    # the policy moved away from the reference after step 1, so the adaptive coefficient moved too
    assert scalars["actor/reward_kl_penalty"][2][1] > 0
    assert scalars["actor/reward_kl_coef"][2][1] != pytest.approx(0.01, abs=0, rel=1e-9)
    assert latest_step(os.path.join(out, "checkpoints")) == 3
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_000003", "critic"))


@pytest.mark.slow
def answer_chain(tokenizer, answer: str) -> list[int] | None:
    """The token ids of `<answer>{answer}</answer><|im_end|>`, or None when an id repeats (a model whose next token
    depends on the current one alone would loop on it)."""
    chain = [tokenizer.convert_tokens_to_ids("<answer>"), *tokenizer.encode(answer, add_special_tokens=False),
             tokenizer.convert_tokens_to_ids("</answer>"), tokenizer.eos_token_id]
    return chain if len(set(chain)) == len(chain) else None


def constant_answer_model(src: str, out: str, answer: str) -> str:
    """A copy of the tiny model at `src` that answers every question with `<answer>{answer}</answer>`, then its
    end-of-turn token: attention and MLP outputs are zeroed (each position's hidden state is its own token's
    embedding), so the next token depends on the current one alone, and the embedding and (untied) output layer make
    that a chain: any token outside the answer -> `<answer>` -> the answer's tokens -> `</answer>` -> `<|im_end|>`.
    The margin of every step is ~100 logits, so sampling at temperature 1 is still this chain."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    chain = answer_chain(tok, answer)
    assert chain is not None, f"{answer!r}: a token repeats in its chain, the model would loop"
    model = AutoModelForCausalLM.from_pretrained(src, tie_word_embeddings=False, dtype=torch.float32)
    hidden = model.config.hidden_size
    assert len(chain) < hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        emb[:, 0] = 1.0  # every token outside the chain: direction 0, followed by chain[0]
        head[chain[0], 0] = 100.0
        for i, (cur, nxt) in enumerate(zip(chain, chain[1:]), start=1):
            emb[cur] = 0.0
            emb[cur, i] = 1.0
            head[nxt, i] = 100.0
    model.config.tie_word_embeddings = False
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow
def test_evaluate_cli_writes_the_table_and_json(world, tiny_model, server, rl_root):
    """tools/evaluate.py on a run root (a checkpoint as training leaves it) of a model that gives one answer to every
    question: EM / sub-EM / F1, searches and finish reasons per data_source and split, as a table and JSON; with
    rollout.max_turns=0 (the no-search baseline) there are no searches. The answer is one of the evaluated questions'
    gold answers, so the right EM is strictly between 0 and 1 and is counted here from the gold answers alone."""
    import pandas as pd

    from tests.test_two_nodes import start_root

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = pd.read_parquet(os.path.join(world, "validation.parquet")).head(4)  # the 4 evaluated (val_max_samples)
    answer = next(a for targets in rows["reward_model"] for a in targets["ground_truth"]["target"]
                  if answer_chain(tok, a) is not None)
    model = constant_answer_model(tiny_model, os.path.join(rl_root, "constant_model"), answer)
    root = start_root(model, os.path.join(rl_root, "constant_root"))
    report_path = os.path.join(rl_root, "eval", "report.json")
    args = [*rl_args(world, model, server, os.path.join(rl_root, "eval")), f"model.megatron_ckpt={root}",
            f"data.val_files=[{world}/validation.parquet,{world}/test.parquet]", "rollout.max_turns=0", "parallel.tp=1",
            "logging.trajectories_per_step=8", "--json", report_path]
    proc = run_module("megatron_searchr1.evaluate", args, nproc=1)
    assert "data_source" in proc.stdout and "split:test" in proc.stdout
    with open(report_path) as f:
        report = json.load(f)
    table = report["table"]
    assert table["split:validation"]["n"] == 4 and table["split:test"]["n"] == 4 and table["all"]["n"] == 8
    assert table["all"]["searches"] == 0.0  # no search turns at all
    assert table["all"]["finish"] == {"answer": 1.0}, table["all"]
    with open(os.path.join(rl_root, "eval", "val_trajectories.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 8
    for rec in samples:  # the model said what it was built to say
        said = "".join(text for kind, text in rec["turns"] if kind == "model")
        assert extract_solution(said) == answer, said
    hits = sum(em_check(answer, rec["target"]) == 1 for rec in samples)
    assert 0 < hits < 8, (answer, [rec["target"] for rec in samples])
    assert table["all"]["em"] == pytest.approx(hits / 8)
    assert table["split:validation"]["em"] >= 0.25  # the question whose answer the model gives is there
