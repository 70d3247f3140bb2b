"""Config: YAML + dotted overrides, typed fields, messages that say what to change, resolved config saved."""
import json
import re

import pytest

from megatron_searchr1.config import Config, ConfigError, describe, load_config, save_config


def test_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("rollout:\n  n: 4\n  max_turns: 2\nalgo:\n  adv_estimator: gae\n")
    cfg = load_config(str(path), ["rollout.max_turns=4", "optim.betas=[0.9,0.95]", "data.train_files=[a,b]",
                                  "model.use_te=null", "algo.clip_ratio_c=null"])
    assert (cfg.rollout.n, cfg.rollout.max_turns, cfg.algo.adv_estimator) == (4, 4, "gae")
    assert cfg.algo.uses_critic and cfg.optim.betas == (0.9, 0.95) and cfg.data.train_files == ["a", "b"]
    assert cfg.model.use_te is None and cfg.algo.clip_ratio_c is None
    # a list set to null is empty, not one item "None"
    assert load_config(str(path), ["data.val_files=null"]).data.val_files == []
    save_config(cfg, str(tmp_path / "out" / "config.yaml"))
    again = load_config(str(tmp_path / "out" / "config.yaml"))
    assert again == cfg  # the saved config reproduces the run's


@pytest.mark.parametrize("override, message", [
    ("rollout.max_turn=4", "did you mean rollout.max_turns"),
    ("algo.adv_estimator=ppo", "algo.adv_estimator must be one of"),
    ("rollout.n=many", "rollout.n: expected a int"),
    ("rollout=3", "rollout is a section"),
    ("rollout.max_turns", "is not KEY=VALUE"),
    ("trainer.val_only=maybe", "expected true/false"),
    ("parallel.sequence_parallel=true", "sequence_parallel needs parallel.tp > 1"),
    ("algo.policy_loss=grpo", "algo.policy_loss must be one of ppo, gspo, cispo"),
    ("algo.loss_agg_mode=sum", "seq-mean-token-sum-norm"),
    ("algo.rollout_correction=tis", "algo.rollout_correction must be one of none, token_tis"),
    ("algo.rollout_correction_high=0", "0 <= low < high"),
    ("algo.llds.gate=token", "algo.llds.gate must be action or response"),
    ("algo.llds.coef=-1", "algo.llds.coef must be >= 0"),
    ("algo.max_gen_batches=0", "algo.max_gen_batches must be >= 1"),
    ("trainer.collapse_nats=0", "trainer.collapse_nats must be > 0"),
])
def test_bad_overrides_say_what_to_change(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_cross_section_rules(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 6, "num_hidden_layers": 4}))
    data = tmp_path / "train.parquet"
    data.write_text("x")
    ok = [f"model.path={model}", f"data.train_files=[{data}]", "trainer.val_before_train=false", "trainer.test_freq=0"]
    load_config(None, ok).validate(world_size=2)
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        load_config(None, ok + ["rollout.n=1"]).validate()
    with pytest.raises(ConfigError, match="does not divide the model's num_attention_heads=6"):
        load_config(None, ok + ["parallel.tp=4"]).validate(world_size=4)
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node 2"):
        load_config(None, ok + ["parallel.tp=2"]).validate(world_size=3)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, ok + ["data.train_files=[nope.parquet]"]).validate()
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(None, ok + [f"model.path={tmp_path}"]).validate()
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["algo.use_kl_in_reward=true"])
    with pytest.raises(ConfigError, match="needs a group estimator"):
        load_config(None, ["algo.adv_estimator=gae", "algo.filter_groups=true"])
    with pytest.raises(ConfigError, match=r"algo.overlong_buffer \(4096\) must be <= rollout.max_response_length"):
        load_config(None, ok + ["algo.overlong_buffer=4096"]).validate()
    with pytest.raises(ConfigError, match="algo.llds acts from a step's second update on"):
        load_config(None, ok + ["algo.llds.coef=0.1"]).validate()
    ok += ["algo.ppo_mini_batch_size=4"]
    load_config(None, ok + ["algo.llds.coef=0.1"]).validate()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 6, "num_hidden_layers": 4,
                                                   "num_experts": 8}))
    with pytest.raises(ConfigError, match="algo.llds on a MoE model .8 experts. needs rollout routing replay"):
        load_config(None, ok + ["algo.llds.coef=0.1"]).validate()
    load_config(None, ok).validate()  # MoE without LLDS is fine


def test_every_field_is_documented():
    lines = describe(Config)
    assert len(lines) > 60
    undocumented = [line for line in lines if line.endswith(": ")]
    assert undocumented == [], undocumented


def test_micro_batch_budget_must_hold_the_longest_trajectory():
    """A trajectory of max_prompt_length + max_response_length tokens must fit one micro-batch:
    plan_micro_batches raises on such a sequence, on one rank, hours into a run."""
    from megatron_searchr1.megatron.batching import plan_micro_batches

    over = ["data.max_prompt_length=512", "rollout.max_response_length=4096", "optim.max_tokens_per_micro_batch=4096"]
    with pytest.raises(ConfigError, match=r"data.max_prompt_length \(512\) \+ rollout.max_response_length \(4096\)"
                                          r".*optim.max_tokens_per_micro_batch \(4096\)"):
        load_config(None, over).validate(check_files=False)
    with pytest.raises(ValueError):  # what would have happened at run time
        plan_micro_batches([512 + 4096], 4096)
    load_config(None, over[:2] + ["optim.max_tokens_per_micro_batch=4608"]).validate(check_files=False)


@pytest.mark.parametrize("recipe", ["grpo_qwen2.5-3b", "grpo_qwen2.5-7b", "ppo_qwen2.5-3b", "ppo_qwen2.5-7b"])
def test_search_r1_recipes_keep_its_entropy_bonus(recipe):
    """Search-R1 trains with verl's default entropy_coeff 0.001 (its scripts do not override it)."""
    import os

    from tests.dist_utils import REPO

    cfg = load_config(os.path.join(REPO, "examples", f"{recipe}.yaml"))
    assert cfg.algo.entropy_coeff == 0.001
    cfg.validate(world_size=8, check_files=False)


def test_the_async_7b_recipe_loads_for_two_nodes():
    """The 2-node asynchronous recipe: one node of trainer ranks, one of rollout ranks (a world of 8 leaves it no
    trainer rank, so it validates at 16)."""
    import os

    from tests.dist_utils import REPO

    cfg = load_config(os.path.join(REPO, "examples", "grpo_qwen2.5-7b_async.yaml"))
    assert cfg.algo.entropy_coeff == 0.001 and cfg.parallel.rollout_placement == "disaggregated"
    cfg.validate(world_size=16, check_files=False)
    with pytest.raises(ConfigError, match="rollout_ranks"):
        cfg.validate(world_size=8, check_files=False)


@pytest.mark.parametrize("recipe, expect", [
    ("grpo_llds_qwen2.5-3b", {"llds.gate": "action", "policy_loss": "ppo"}),
    ("dapo_qwen2.5-3b", {"filter_groups": True, "overlong_buffer": 512, "clip_ratio_high": 0.28}),
    ("gspo_qwen2.5-3b", {"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean", "gspo_clip_ratio_low": 3e-4}),
])
def test_toolkit_recipes_load_and_set_their_algorithm(recipe, expect):
    """The issue-31 recipes pass the config's own checks and turn on what their names say."""
    import os

    from tests.dist_utils import REPO

    cfg = load_config(os.path.join(REPO, "examples", f"{recipe}.yaml"))
    cfg.validate(world_size=8, check_files=False)
    for key, value in expect.items():
        obj = cfg.algo
        for part in key.split("."):
            obj = getattr(obj, part)
        assert obj == value, key
    assert cfg.algo.llds.enabled is (recipe == "grpo_llds_qwen2.5-3b")


@pytest.mark.parametrize("text, line, message", [
    # a second trainer: section replaced the first whole (the run wrote to runs/default, test_freq 0 became 25)
    ("trainer:\n  output_dir: runs/mine\n  test_freq: 0\nrollout:\n  n: 4\ntrainer:\n  total_steps: 3\n", 6,
     "section 'trainer' appears a second time (first on line 1)"),
    ("rollout:\n  n: 4\n  max_turns: 2\n  n: 8\n", 4, "key 'n' appears a second time (first on line 2)"),
    ("algo:\n  llds:\n    coef: 0.1\n    coef: 0.2\n", 4, "key 'coef' appears a second time (first on line 3)"),
])
def test_duplicated_yaml_keys_and_sections_are_refused_naming_the_line(tmp_path, text, line, message):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}:{line}: {re.escape(message)}; YAML would keep only the last one"):
        load_config(str(path))


def test_the_same_key_in_two_sections_and_merge_keys_still_load(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("base: &b\n  n: 4\nrollout:\n  <<: *b\n  max_turns: 3\ntrainer:\n  total_steps: 3\n")
    import yaml

    from megatron_searchr1.config.loader import read_yaml

    assert read_yaml(str(path))["rollout"] == {"n": 4, "max_turns": 3} == yaml.safe_load(path.read_text())["rollout"]
    path.write_text("rollout:\n  n: 4\nalgo:\n  llds:\n    coef: 0.1\n  kl_coef: 0.1\n")  # one name, two places
    assert load_config(str(path)).rollout.n == 4


def test_a_duplicated_section_is_one_error_line_from_train(tmp_path):
    import subprocess
    import sys

    from tests.dist_utils import REPO
    from tests.rl_fixtures import child_env

    path = tmp_path / "exp.yaml"
    path.write_text("trainer:\n  test_freq: 0\ntrainer:\n  total_steps: 3\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_searchr1.train", str(path)], cwd=REPO, capture_output=True,
                          text=True, env=child_env(), timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: {path}:3: section 'trainer' appears a second time (first on line 1)")
