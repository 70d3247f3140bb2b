"""algo.routing_replay (MoE routing replay): refused where there is nothing to replay or no ids to replay; LLDS on an
MoE model needs it."""
import json

import pytest

from megatron_searchr1.config import ConfigError, load_config


def _paths(tmp_path, experts):
    model = tmp_path / "m"
    model.mkdir()
    cfg = {"num_attention_heads": 6, "num_hidden_layers": 4, **({"num_experts": experts} if experts else {})}
    (model / "config.json").write_text(json.dumps(cfg))
    data = tmp_path / "train.parquet"
    data.write_text("x")
    return [f"model.path={model}", f"data.train_files=[{data}]", "trainer.val_before_train=false",
            "trainer.test_freq=0", "algo.ppo_mini_batch_size=4"]


def test_off_by_default_and_refused_on_a_dense_model(tmp_path):
    ok = _paths(tmp_path, experts=None)
    assert load_config(None, ok).algo.routing_replay is False
    with pytest.raises(ConfigError, match="algo.routing_replay replays the experts of a mixture-of-experts model; .* "
                                          "is dense"):
        load_config(None, ok + ["algo.routing_replay=true"]).validate()


def test_needs_the_vllm_engine_and_no_full_recompute():
    with pytest.raises(ConfigError, match="rollout.engine=hf records none: set rollout.engine=vllm"):
        load_config(None, ["algo.routing_replay=true", "rollout.engine=hf"])
    with pytest.raises(ConfigError, match="model.recompute=full is not supported"):
        load_config(None, ["algo.routing_replay=true", "model.recompute=full"])
    with pytest.raises(ConfigError, match="does not cover tree rollouts or rollout.partial"):
        load_config(None, ["algo.routing_replay=true", "parallel.rollout_placement=disaggregated",
                           "parallel.rollout_ranks=1", "rollout.partial=true"])


def test_llds_on_moe_needs_replay_and_runs_with_it(tmp_path):
    ok = _paths(tmp_path, experts=8)
    with pytest.raises(ConfigError, match=r"algo.llds on a MoE model \(8 experts\) needs rollout routing replay: set "
                                          r"algo.routing_replay=true"):
        load_config(None, ok + ["algo.llds.coef=0.1"]).validate()
    load_config(None, ok + ["algo.llds.coef=0.1", "algo.routing_replay=true"]).validate()
    # rollout correction compares engine and trainer log-probs: allowed on MoE, with or without replay
    load_config(None, ok + ["algo.rollout_correction=token_tis"]).validate()
    load_config(None, ok + ["algo.rollout_correction=token_tis", "algo.routing_replay=true"]).validate()
