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

Two facts meet here. vLLM's `external_launcher` builds its TP groups from *consecutive* global ranks
(``arange(world).reshape(-1, engine_tp)``). Megatron orders ranks tp-cp-ep-dp-pp (tp varies fastest; cp = ep = 1
here), so a model replica (model-parallel group, one DP rank) is *not* contiguous once PP > 1 and DP > 1: with
tp=2, pp=2, dp=2 the replicas are [0, 1, 4, 5] and [2, 3, 6, 7]. An engine must hold one replica's trajectories
(all its ranks send the same prompts), so an engine group that straddles two replicas would receive two
different prompt lists: a hang or garbage. With DP > 1 every step from one rank to the next that leaves a
tensor-parallel group also leaves the replica, so the rule is: ``engine_tp`` divides ``parallel.tp``, or DP = 1.

Pure arithmetic, no torch or megatron import: `Config.validate` runs it before anything heavy is loaded; the tests
check it against megatron.core's own RankGenerator for every layout up to 64 ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence, TypeVar

T = TypeVar("T")

SHARE_SEED_STRIDE = 104_729
"""Seeds of two engines lie this far apart; the loop adds the turn number to a seed, so engines must be further
apart than any rollout has turns."""


class LayoutError(ValueError):
    """An engine layout that cannot serve Megatron's replicas; the message names the fields to change."""


def replicas(world: int, tp: int, pp: int) -> list[list[int]]:
    """Megatron's model-parallel groups (one per DP rank), ranks ascending: rank = t + tp * d + tp * dp * p.

    >>> replicas(8, tp=2, pp=2)
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    dp = world // (tp * pp)
    return [sorted(t + tp * d + tp * dp * p for p in range(pp) for t in range(tp)) for d in range(dp)]


def engine_groups(world: int, engine_tp: int) -> list[list[int]]:
    """vLLM's TP groups under `external_launcher`: consecutive blocks of `engine_tp` global ranks.

    >>> engine_groups(4, 2)
    [[0, 1], [2, 3]]
    """
    return [list(range(start, start + engine_tp)) for start in range(0, world, engine_tp)]


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
        w, tp, pp, e = self.world, self.tp, self.pp, self.engine_tp
        if w % (tp * pp):
            raise LayoutError(f"world size {w} is not a multiple of parallel.tp * parallel.pp = {tp * pp}")
        if e < 1 or w % e:
            raise LayoutError(f"rollout.engine_tp={e} must divide the world size {w}")
        replica_of = self.replica_of
        for group in self.groups:
            spanned = sorted({replica_of[r] for r in group})
            if len(spanned) > 1:
                first = replicas(w, tp, pp)[spanned[0]]
                raise LayoutError(
                    f"rollout.engine_tp={e} puts ranks {group} in one vLLM engine (vLLM groups consecutive ranks), "
                    f"but with parallel.tp={tp}, parallel.pp={pp} and DP={self.dp} Megatron places them in "
                    f"{len(spanned)} model replicas (rank order tp-dp-pp; replica {spanned[0]} = ranks {first}). "
                    f"With DP > 1 an engine must fit in one tensor-parallel group: set rollout.engine_tp to a divisor "
                    f"of parallel.tp={tp}, or raise parallel.tp / parallel.pp until DP = 1")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @cached_property
    def groups(self) -> list[list[int]]:
        return engine_groups(self.world, self.engine_tp)

    @cached_property
    def replica_of(self) -> list[int]:
        """DP rank (replica) of every global rank."""
        out = [0] * self.world
        for d, ranks in enumerate(replicas(self.world, self.tp, self.pp)):
            for r in ranks:
                out[r] = d
        return out

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
