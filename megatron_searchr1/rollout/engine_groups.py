"""Which ranks share one vLLM engine, which model replica (DP rank) each engine serves, and its sampling seed.

    layout = EngineLayout(world=8, tp=2, pp=2, engine_tp=2)     # raises LayoutError where no engine can serve
    layout.groups                  # [[0, 1], [2, 3], [4, 5], [6, 7]]: vLLM's TP groups (consecutive ranks)
    shard = layout.shard(rank, "replica")   # training: this engine runs shard.take(replica's trajectories)
    shard = layout.shard(rank, "world")     # validation: this engine runs shard.take(all validation rows)
    layout.sampling_seed(seed, rank)

The one sharding rule, for training and validation rollouts alike: a list that several engines hold in common is
split round-robin over those engines, `items[k::n]` for the k-th of the n engines in rank order, and every engine's
first rank hands in its results (`Shard.contributes`; the engine's other ranks computed the same ones). Only the
scope differs: a training batch is one replica's (its tp*pp ranks hold the same trajectories; the results are
exchanged inside the model-parallel group), the validation rows are everybody's (split over every engine; the
results are gathered over all ranks).

Which layouts can work at all (an engine group must lie inside one model replica) is config/layout.py's rule,
checked by `Config.validate` before anything heavy loads and again when an EngineLayout is built; the replica and
engine-group arithmetic is imported from there. Pure arithmetic, no torch or megatron import.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence, TypeVar

from megatron_searchr1.config.layout import LayoutError  # noqa: F401 (what EngineLayout raises; callers catch it)
from megatron_searchr1.config.layout import check_engine_layout, engine_groups, replica_of

T = TypeVar("T")

SHARE_SEED_STRIDE = 104_729
"""Seeds of two engines lie this far apart; the loop adds the turn number to a seed, so engines must be further
apart than any rollout has turns."""


@dataclass(frozen=True)
class Shard:
    """One engine's part of a list that `count` engines split (EngineLayout.shard)."""

    index: int
    """This engine's position among the engines that split the list (rank order)."""
    count: int
    """How many engines split it."""
    contributes: bool
    """Whether this rank hands in its engine's results (the engine's first rank does)."""

    def take(self, items: Sequence[T]) -> list[T]:
        """This engine's items: every `count`-th, from `index`.

        >>> Shard(1, 3, True).take("abcdefg")
        ['b', 'e']
        """
        return list(items[self.index::self.count])

    def merge(self, parts: dict[int, list]) -> list:
        """Every engine's results (shard index -> that engine's `take`, processed) back in the order of the list.

        >>> Shard(0, 2, True).merge({1: ["b", "d"], 0: ["a", "c", "e"]})
        ['a', 'b', 'c', 'd', 'e']
        """
        if sorted(parts) != list(range(self.count)):
            raise ValueError(f"results of shards {sorted(parts)}, expected shards 0..{self.count - 1}")
        out: list = [None] * sum(len(p) for p in parts.values())
        for k, part in parts.items():
            out[k::self.count] = part
        return out


@dataclass(frozen=True)
class EngineLayout:
    """Engine groups over Megatron's replicas; construction checks that every engine lies inside one replica."""

    world: int
    tp: int
    pp: int
    engine_tp: int

    def __post_init__(self):
        check_engine_layout(self.world, self.tp, self.pp, self.engine_tp)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @cached_property
    def groups(self) -> list[list[int]]:
        return engine_groups(self.world, self.engine_tp)

    @cached_property
    def replica_of(self) -> list[int]:
        """DP rank (replica) of every global rank."""
        return replica_of(self.world, self.tp, self.pp)

    def group_of(self, rank: int) -> int:
        """Index of `rank`'s engine in `groups` (the same on every rank of that engine)."""
        return rank // self.engine_tp

    def replica_groups(self, dp_rank: int) -> list[int]:
        """Indices of the engines that serve replica `dp_rank`, ascending."""
        replica_of = self.replica_of
        return [g for g, ranks in enumerate(self.groups) if replica_of[ranks[0]] == dp_rank]

    def shard(self, rank: int, scope: str) -> Shard:
        """`rank`'s part of a list split over engines (the module doc's rule). scope "replica": the list is one
        replica's (training trajectories), split over that replica's engines; "world": every rank holds the same
        list (validation rows), split over all engines.

        >>> L = EngineLayout(8, tp=2, pp=2, engine_tp=2)  # replica 0 = [0, 1, 4, 5]: engines [0,1], [4,5]
        >>> L.shard(5, "replica"), L.shard(5, "world")
        (Shard(index=1, count=2, contributes=False), Shard(index=2, count=4, contributes=False))
        """
        group = self.group_of(rank)
        if scope == "replica":
            engines = self.replica_groups(self.replica_of[rank])
        elif scope == "world":
            engines = list(range(len(self.groups)))
        else:
            raise ValueError(f"scope must be 'replica' or 'world', got {scope!r}")
        return Shard(engines.index(group), len(engines), contributes=rank == self.groups[group][0])

    def sampling_seed(self, step_seed: int, rank: int) -> int:
        """The rollout's base seed on `rank`: the step's seed plus an offset per engine, so engines of different
        replicas (DP ranks) and different shares of one replica draw different noise, and the ranks of one
        engine agree (vLLM needs that).

        >>> L = EngineLayout(4, tp=1, pp=1, engine_tp=1)
        >>> len({L.sampling_seed(7, r) for r in range(4)})  # four DP ranks, four seeds
        4
        """
        return step_seed + self.group_of(rank) * SHARE_SEED_STRIDE
