"""The disaggregated placement's config rules (config/rl.py: ParallelConfig.rollout_placement / rollout_ranks,
RolloutConfig.max_staleness / partial, Config.trainer_world, Config.check_placement): what it refuses, in one message that
names the field to change, and the trainer's world it leaves."""
from __future__ import annotations

import pytest

from megatron_searchr1.config import Config, ConfigError, load_config

DISAGG = ["parallel.rollout_placement=disaggregated", "parallel.rollout_ranks=1", "data.val_files=[]"]


def cfg(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def test_colocated_is_the_default_and_keeps_the_whole_world():
    c = cfg()
    assert (c.parallel.rollout_placement, c.parallel.rollout_ranks, c.rollout.max_staleness) == ("colocated", 0, 0)
    assert c.trainer_world(4) == 4
    c.validate(world_size=4, check_files=False)


def test_disaggregated_trains_on_the_ranks_left():
    c = cfg(*DISAGG, "parallel.tp=2", "rollout.max_staleness=2", "data.train_batch_size=4",
            "algo.ppo_mini_batch_size=4")
    assert c.trainer_world(3) == 2
    c.validate(world_size=3, check_files=False)  # 2 trainer ranks at TP=2 (DP=1) + 1 rollout rank


def test_partial_rollouts_are_a_disaggregated_option():
    c = cfg(*DISAGG, "rollout.partial=true")
    assert c.rollout.partial and not cfg().rollout.partial  # off by default
    c.validate(world_size=3, check_files=False)


def test_streamed_groups_are_a_disaggregated_option():
    c = cfg(*DISAGG, "rollout.async_granularity=group", "rollout.groups_in_flight=3")
    assert (c.rollout.async_granularity, c.rollout.groups_in_flight) == ("group", 3)
    assert cfg().rollout.async_granularity == "share"  # the default
    c.validate(world_size=3, check_files=False)


def test_disaggregated_validates_on_its_rollout_ranks():
    # validation runs on the rollout ranks between versions (trainer/rollout_rank.py): val files are accepted
    cfg(*DISAGG[:2], "data.val_files=[v.parquet]", "trainer.test_freq=2").validate(world_size=3, check_files=False)


def test_disaggregated_launches_retrieval_from_its_rollout_ranks():
    # the first rollout rank on each node starts the server (trainer/rollout_rank.py serve_rollouts)
    cfg(*DISAGG, "retrieval.launch=true", "retrieval.server_args=[--index-dir,x]").validate(world_size=3,
                                                                                             check_files=False)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.rollout_placement=disaggregated"], 3, "parallel.rollout_ranks >= 1"),
    (["parallel.rollout_ranks=1"], 3, "parallel.rollout_placement=disaggregated"),
    (["parallel.rollout_placement=sideways"], 3, "colocated or disaggregated"),
    (["rollout.max_staleness=-1"], 3, "rollout.max_staleness must be >= 0"),
    # partial rollouts load weights mid-trajectory: only rollout ranks of their own do that
    (["rollout.partial=true"], 3, "set parallel.rollout_placement=disaggregated or rollout.partial=false"),
    (["rollout.async_granularity=group"], 3, "or rollout.async_granularity=share"),
    ([*DISAGG, "rollout.async_granularity=batch"], 3, "must be share or group, got 'batch'"),
    ([*DISAGG, "rollout.groups_in_flight=-1"], 3, "rollout.groups_in_flight must be >= 0"),
    ([*DISAGG[:1], "parallel.rollout_ranks=3", "data.val_files=[]"], 3, "leaves no trainer rank"),
    ([*DISAGG, "rollout.engine_tp=2"], 4, "rollout.engine_tp=1"),
    ([*DISAGG, "parallel.pp=2"], 3, "parallel.pp=1"),
    ([*DISAGG, "model.lora.rank=8"], 3, "model.lora.rank=0"),
    ([*DISAGG, "algo.filter_groups=true"], 3, "algo.filter_groups=false"),
    ([*DISAGG, "trainer.val_only=true"], 3, "parallel.rollout_placement=colocated"),
    # the DP checks apply to the trainer's world: 3 ranks - 1 = 2 trainer ranks at TP=1 is DP=2
    ([*DISAGG, "data.train_batch_size=3", "algo.ppo_mini_batch_size=3"], 3, "multiple of the DP size 2"),
    ([*DISAGG, "parallel.tp=2"], 4, "leaves 3 trainer ranks of 4"),
])
def test_unsupported_layouts_are_refused_naming_the_field(overrides, world, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cfg(*overrides).validate(world_size=world, check_files=False)
