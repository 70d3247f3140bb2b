"""Prefix packing for the forward-only passes: the leaves of one tree (rollout/tree.py) as one sequence, each shared
token computed once.

    mbs = packed_micro_batches(seqs, keys=[c.tree for c in coords], max_tokens_per_micro_batch=8192)
    out = schedule.forward_per_sequence(model, mbs)      # per leaf, in input order: as make_micro_batches gives it

A tree's leaves share their prompt and the turns before each branch point. Per leaf (the baseline, and what the
update's forward+backward still does) every shared token is computed once per leaf holding it. Packed, the leaves of
one key become one row laid out as a trie: the first leaf whole, then each later leaf's tokens after its longest
common prefix with an earlier leaf (`pack_rows`). Which tokens are shared is read from the token ids, not from the
tree's bookkeeping: two leaves with equal ids up to position p compute equal hidden states there, whatever grew them.

What makes the packed row compute what each leaf's own sequence computes:
  * attention mask (n, 1, S, S), True = masked (Megatron's convention): token q attends to k only when k lies on q's
    path (one of its ancestors in the trie, or itself); padding columns attend to themselves only;
  * position ids (n, S): a token's depth in its own leaf, and RoPE is computed at those positions
    (`rope_at_positions`: Megatron's RotaryEmbedding otherwise uses 0..S-1 for every row);
  * outputs are read per leaf: response token j of leaf i is predicted at the packed position of its leaf's token
    P_i + j - 1 (P_i: prompt length) with leaf i's own next token as the target, so at a branch point the same
    packed position predicts a different token for each branch. The result is (b_leaves, R), as for a MicroBatch.

Exactness is to fp32 rounding: the attention sums run over the same keys in a different kernel (tested against the
per-leaf forward in tests/megatron/test_tree_packing.py). Cost: the dense [S, S] mask makes attention quadratic in
the packed length S (per leaf it is quadratic in each leaf's length), and a masked kernel cannot skip blocks the way
a causal one does; tools/benchmarks/bench_tree_pack.py measures where it pays.

Parallelism: TP splits heads and the vocabulary as usual (the log-probs go through vocab_parallel_log_probs like
any micro-batch's); sequence parallelism pads S to a multiple of TP (`padded_to`, mask and positions included); PP
stages receive the same packed micro-batches (the plan is a pure function of the ids, equal on every rank) and each
stage's RoPE and attention read the same mask and positions. Context parallelism is not supported (the local
attention refuses it).

Transformer Engine (GPU): Megatron builds TE's DotProductAttention with the layer spec's mask type (causal), for
which TE ignores any `attention_mask` argument, and its fused/flash backends have no arbitrary-mask path; a packed
row would silently attend across branches. So packing refuses a TE-built model (`check_packable`): set
rollout.tree.pack_forward=false there (the per-leaf forward) or model.use_te=false.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Hashable, Mapping, Optional, Sequence, Union

import torch

from megatron_searchr1.megatron.batching import (MicroBatch, TrainSequence, _as_long, _collate, as_sequence,
                                                 plan_micro_batches, sequence_lengths)


# ------------------------------------------------------------------------------------------------ the trie layout
@dataclasses.dataclass
class PackedRow:
    """One packed sequence: `tokens` (S,) once each, `depth` (S,) each token's position in its own leaf, and per
    leaf the packed index of each of its tokens (`paths[i]`, len = the leaf's length)."""

    leaves: list[int]
    tokens: list[int]
    depth: list[int]
    paths: list[list[int]]


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def pack_rows(token_lists: Sequence[Sequence[int]], leaves: Sequence[int]) -> PackedRow:
    """The trie of `token_lists` (each a leaf's prompt + response ids) laid out in one row: leaf 0 whole, then every
    later leaf's tokens after its longest common prefix with any earlier leaf (its branch point).

    >>> r = pack_rows([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]], [0, 1, 2])
    >>> r.tokens, r.depth, r.paths
    ([1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 2, 3, 4], [[0, 1, 2, 3], [0, 1, 4], [0, 1, 2, 5, 6]])
    """
    tokens: list[int] = []
    depth: list[int] = []
    paths: list[list[int]] = []
    seen: list[torch.Tensor] = []
    for ids in token_lists:
        t = _as_long(ids)
        best, shared = -1, 0
        for k, other in enumerate(seen):
            n = _common_prefix(t, other)
            if n > shared:
                best, shared = k, n
        path = paths[best][:shared] if best >= 0 else []
        start = len(tokens)
        tokens.extend(t[shared:].tolist())
        depth.extend(range(shared, t.numel()))
        paths.append(path + list(range(start, len(tokens))))
        seen.append(t)
    return PackedRow(list(leaves), tokens, depth, paths)


def plan_packs(seqs: Sequence[TrainSequence], keys: Sequence[Hashable], max_tokens: int) -> list[PackedRow]:
    """One PackedRow per key (a tree), in order of first appearance; a tree whose packed length exceeds
    `max_tokens` is cut into several rows, leaves in input order, each as long as fits (a leaf alone always fits:
    make_micro_batches's own rule)."""
    if len(keys) != len(seqs):
        raise ValueError(f"{len(keys)} pack keys for {len(seqs)} sequences: give one key (tree id) per sequence")
    lengths = sequence_lengths(seqs)
    if max(lengths, default=0) > max_tokens:
        raise ValueError(f"a sequence has {max(lengths)} tokens but max_tokens_per_micro_batch is {max_tokens}: "
                         "raise the budget to at least max prompt + max response length")
    groups: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    rows = []
    for members in groups.values():
        ids = {i: _as_long(seqs[i].prompt_ids).tolist() + _as_long(seqs[i].response_ids).tolist() for i in members}
        whole = pack_rows([ids[i] for i in members], members)
        if len(whole.tokens) <= max_tokens:
            rows.append(whole)
            continue
        current: list[int] = []
        for i in members:
            trial = pack_rows([ids[j] for j in current + [i]], current + [i])
            if current and len(trial.tokens) > max_tokens:
                rows.append(pack_rows([ids[j] for j in current], current))
                current = [i]
            else:
                current.append(i)
        rows.append(pack_rows([ids[j] for j in current], current))
    return rows


def forward_token_counts(seqs: Sequence[Union[TrainSequence, Mapping[str, Any]]], keys: Sequence[Hashable],
                         max_tokens: int) -> tuple[int, int]:
    """(tokens a packed forward computes, tokens the per-leaf forward computes), padding left out of both."""
    seqs = [as_sequence(s) for s in seqs]
    packed = sum(len(r.tokens) for r in plan_packs(seqs, keys, max_tokens))
    return packed, sum(sequence_lengths(seqs))


# ------------------------------------------------------------------------------------------------ micro-batches
@dataclasses.dataclass(kw_only=True)
class PackedMicroBatch(MicroBatch):
    """A MicroBatch whose rows are packed trees: `input_ids` (n, S) are the packed rows, while `indices`,
    `prompt_lens`, `response_lens`, `response_mask` and `fields` stay per leaf (b leaves), so the schedule's readers
    (forward_per_sequence, restore_order) see leaves as they see rows. For forward-only passes."""

    position_ids: torch.Tensor    # (n, S) long: each token's position in its own leaf
    attention_mask: torch.Tensor  # (n, 1, S, S) bool, True = masked
    leaf_rows: torch.Tensor       # (b,) long: the packed row holding each leaf
    leaf_positions: torch.Tensor  # (b, R) long: the packed position that predicts response token j
    leaf_targets: torch.Tensor    # (b, R) long: response token j of the leaf, 0 on padding
    packed_tokens: int = 0
    """Tokens of the packed rows before padding."""

    @property
    def num_rows(self) -> int:
        return len(self.indices)

    @property
    def num_real_tokens(self) -> int:
        return self.packed_tokens

    def response_rows(self) -> torch.Tensor:
        return self.leaf_rows.unsqueeze(1).expand_as(self.leaf_positions)

    def response_positions(self) -> torch.Tensor:
        return self.leaf_positions

    def response_targets(self) -> torch.Tensor:
        return self.leaf_targets

    def run(self, model_chunk: torch.nn.Module) -> torch.Tensor:
        with rope_at_positions(model_chunk, self.position_ids):
            return model_chunk(self.input_ids, self.position_ids, self.attention_mask)

    def padded_to(self, multiple: int) -> "PackedMicroBatch":
        """Columns padded to a multiple (sequence parallelism): pad tokens at position 0, each attending to itself."""
        n, S = self.input_ids.shape
        extra = -S % multiple
        if extra == 0:
            return self
        mask = torch.ones(n, 1, S + extra, S + extra, dtype=torch.bool, device=self.attention_mask.device)
        mask[:, :, :S, :S] = self.attention_mask
        idx = torch.arange(S, S + extra, device=mask.device)
        mask[:, :, idx, idx] = False
        return dataclasses.replace(
            self, input_ids=torch.cat([self.input_ids, self.input_ids.new_zeros(n, extra)], dim=1),
            position_ids=torch.cat([self.position_ids, self.position_ids.new_zeros(n, extra)], dim=1),
            attention_mask=mask)

    def to(self, device) -> "PackedMicroBatch":
        base = MicroBatch.to(self, device)
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(base, position_ids=move(self.position_ids),
                                   attention_mask=move(self.attention_mask), leaf_rows=move(self.leaf_rows),
                                   leaf_positions=move(self.leaf_positions), leaf_targets=move(self.leaf_targets))


def _collate_packed(seqs: Sequence[TrainSequence], rows: Sequence[PackedRow], pad_id: int) -> PackedMicroBatch:
    leaves = [i for r in rows for i in r.leaves]
    per_leaf = _collate(seqs, leaves, pad_id)  # prompt/response lengths, response mask and fields per leaf
    n, S = len(rows), max(len(r.tokens) for r in rows)
    input_ids = torch.full((n, S), pad_id, dtype=torch.long)
    position_ids = torch.zeros(n, S, dtype=torch.long)
    allowed = torch.zeros(n, S, S, dtype=torch.bool)
    R = per_leaf.response_mask.shape[1]
    leaf_rows = torch.empty(len(leaves), dtype=torch.long)
    leaf_positions = torch.zeros(len(leaves), R, dtype=torch.long)
    leaf_targets = torch.zeros(len(leaves), R, dtype=torch.long)
    b = 0
    for k, r in enumerate(rows):
        input_ids[k, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
        position_ids[k, : len(r.depth)] = torch.tensor(r.depth, dtype=torch.long)
        for path in r.paths:
            p = torch.tensor(path, dtype=torch.long)  # (L,) packed index of each of the leaf's tokens
            L = p.numel()
            # token at depth t sees the leaf's tokens at depth <= t (causal along its own path)
            allowed[k][p.unsqueeze(1), p.unsqueeze(0)] |= torch.ones(L, L, dtype=torch.bool).tril()
            P, Rl = int(per_leaf.prompt_lens[b]), int(per_leaf.response_lens[b])
            leaf_rows[b] = k
            leaf_positions[b, :Rl] = p[P - 1: P - 1 + Rl]
            leaf_targets[b, :Rl] = input_ids[k, p[P: P + Rl]]
            b += 1
        pad = torch.arange(len(r.tokens), S)
        allowed[k, pad, pad] = True  # padding attends to itself only (no fully masked row)
    return PackedMicroBatch(
        indices=leaves, input_ids=input_ids, prompt_lens=per_leaf.prompt_lens, response_lens=per_leaf.response_lens,
        response_mask=per_leaf.response_mask, fields=per_leaf.fields, position_ids=position_ids,
        attention_mask=(~allowed).unsqueeze(1), leaf_rows=leaf_rows, leaf_positions=leaf_positions,
        leaf_targets=leaf_targets, packed_tokens=sum(len(r.tokens) for r in rows))


def packed_micro_batches(seqs: Sequence[Union[TrainSequence, Mapping[str, Any]]], keys: Sequence[Hashable],
                         max_tokens_per_micro_batch: int, pad_id: int = 0,
                         micro_batch_cost_tokens: Optional[int] = None) -> list[PackedMicroBatch]:
    """The sequences' packed micro-batches: one packed row per key (`plan_packs`), rows grouped by
    plan_micro_batches over the packed lengths within the same token budget (rows x longest packed row). Read the
    results back with forward_per_sequence / restore_order as for make_micro_batches: per leaf, in input order."""
    if not seqs:
        return []
    seqs = [as_sequence(s) for s in seqs]
    rows = plan_packs(seqs, keys, max_tokens_per_micro_batch)
    plan = plan_micro_batches([len(r.tokens) for r in rows], max_tokens_per_micro_batch, micro_batch_cost_tokens)
    return [_collate_packed(seqs, [rows[k] for k in group], pad_id) for group in plan]


# ------------------------------------------------------------------------------------------------ the model side
@contextlib.contextmanager
def rope_at_positions(model_chunk: torch.nn.Module, position_ids: torch.Tensor):
    """While it is open, every RotaryEmbedding of `model_chunk` returns the frequencies at `position_ids` (n, S),
    shaped [S, n, 1, d] (it broadcasts over the heads in Megatron's RoPE and in models/attention.py), instead of
    those of positions 0..S-1 ([S, 1, 1, d])."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    ropes = [m for m in model_chunk.modules() if isinstance(m, RotaryEmbedding)]
    for rope in ropes:
        def at_positions(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None, rope=rope):
            if max_seq_len != position_ids.shape[1] or offset:
                raise ValueError(f"packed RoPE asked for {max_seq_len} positions at offset {offset}; the packed rows "
                                 f"have {position_ids.shape[1]}")
            emb = rope.get_emb(int(position_ids.max()) + 1)  # [P, 1, 1, d]
            return emb[:, 0, 0][position_ids.t().to(emb.device)].unsqueeze(2)  # [S, n, 1, d]
        rope.forward = at_positions  # an instance attribute: shadows the class's (lru-cached) forward
    try:
        yield
    finally:
        for rope in ropes:
            del rope.forward


def check_packable(model: torch.nn.Module) -> None:
    """Raise unless `model` honours an arbitrary attention mask and per-token RoPE positions: Megatron's local spec
    with our SDPAttention, plain RoPE (module doc: Transformer Engine)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_searchr1.models.forward import unwrap
    from megatron_searchr1.models.spec import uses_te_spec

    bare = unwrap(model)
    if uses_te_spec(bare):
        raise RuntimeError("rollout.tree.pack_forward=true needs attention with an arbitrary mask, and this model was "
                           "built with Transformer Engine, whose causal attention ignores the packed mask: set "
                           "rollout.tree.pack_forward=false (each leaf its own sequence) or model.use_te=false")
    rope = getattr(bare, "rotary_pos_emb", None)
    if getattr(bare, "position_embedding_type", "rope") != "rope" or type(rope) is not RotaryEmbedding:
        raise RuntimeError(f"rollout.tree.pack_forward=true supports plain RoPE models, not position embedding "
                           f"{getattr(bare, 'position_embedding_type', None)!r} ({type(rope).__name__}): set "
                           "rollout.tree.pack_forward=false")
    if bare.config.context_parallel_size > 1:
        raise RuntimeError("rollout.tree.pack_forward=true does not support context parallelism: set "
                           "rollout.tree.pack_forward=false or parallel.cp=1")
