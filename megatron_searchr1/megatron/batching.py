"""Token-budget micro-batches and PPO mini-batches: how a DP rank's sequences reach the model.

    minis = split_mini_batches(len(seqs), num_mini_batches=4, seed=epoch)          # index lists
    mbs = make_micro_batches([seqs[i] for i in minis[0]], max_tokens_per_micro_batch=8192)
    per_seq = restore_order([per_row_results_of(mb) for mb in mbs], mbs)          # back in input order

A sequence is a `TrainSequence`: prompt and response token ids, the loss mask, and the per-response-token fields
that the RL step fills in one by one (engine / old / reference log-probs, values, advantages, returns). A record,
not a dict: a misspelt field is an AttributeError where it is written, not a new key that nothing reads. Scripts
may pass plain mappings instead; `as_sequence` turns each into a record (an unknown key is a TypeError).

Packing: sequences are sorted by total length, longest first (ties: input order), and cut into consecutive
micro-batches whose *padded* size, rows x longest row, stays within `max_tokens_per_micro_batch`; the cuts
minimise padding plus a small charge per micro-batch (`plan_micro_batches`). Sorting puts similar lengths
together, so padding stays small (tools/benchmarks/bench_padding.py measures it
against Search-R1's layout, where every row is padded to max_prompt + max_response). The packing is a pure
function of the lengths, so every rank of a model-parallel group (same input) gets the same plan.

Layout of one micro-batch (`MicroBatch`), right-padded because Megatron's RoPE uses positions 0..T-1:

    input_ids      (b, T)        prompt + response, then `pad_id`
    response_mask  (b, R)        1.0 on the response tokens, R = longest response in the micro-batch
    fields[k]      (b, R)        the sequences' per-response-token fields that are set, zero-padded to R
    prompt_lens, response_lens (b,)

Under sequence parallelism schedule.py pads input_ids to a multiple of TP columns (`MicroBatch.padded_to`).

Response token j of row i sits at position prompt_lens[i] + j of input_ids and is predicted from position
prompt_lens[i] + j - 1: `response_positions` gives those positions (outputs.py gathers log-probs and values
there, verl's `[:, prompt_len - 1 : -1]`).

Data parallelism: every DP rank packs its own share. Only the pipeline stages of one DP rank share a
schedule, so DP ranks may run different numbers of micro-batches (gradients are all-reduced once, after
the schedule). They must run the same number of *optimizer steps*: `split_mini_batches` cuts by a count,
not by a size, so equal shares give equal counts.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Mapping, Optional, Sequence, Union

import torch


@dataclasses.dataclass(slots=True, eq=False)
class TrainSequence:
    """One sequence on its way to the model: a rollout's trajectory (trainer/losses.to_sequences) or an SFT example
    (trainer/losses.sft_sequence). Every tensor field is per response token, shape (R,), R = len(response_ids);
    the optional ones are None until the step that computes them (trainer/rl.py) sets them."""

    prompt_ids: list
    """Prompt token ids (list of ints or a 1-D tensor); at least one: response token 0 is predicted from it."""
    response_ids: list
    """Response token ids: what the model generated plus the observations appended between its turns."""
    loss_mask: torch.Tensor
    """1.0 on the tokens the loss sees (generated ones), 0.0 on observations and on dropped trajectories."""
    engine_log_probs: Optional[torch.Tensor] = None
    """The rollout engine's log-probs of the generated tokens (0 on observations)."""
    old_log_probs: Optional[torch.Tensor] = None
    """The actor's log-probs before this step's update (None on the on-policy path: the update computes them)."""
    ref_log_probs: Optional[torch.Tensor] = None
    """The frozen reference's log-probs (KL terms only)."""
    values: Optional[torch.Tensor] = None
    """The critic's values (GAE only)."""
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None
    """The per-token reward the advantages were computed from (outcome score, minus the KL penalty in the reward)."""
    routed_experts: Optional[torch.Tensor] = None
    """MoE routing replay: (P + R, moe_layers, topk) int expert ids the engine routed each token of prompt AND
    response to, -1 where it computed none (megatron/routing_replay.py). Not a per-response-token field."""


WHOLE_SEQUENCE_FIELDS = ("routed_experts",)
"""TrainSequence fields that cover every token (prompt and response), collated to (b, T, ...) apart."""
TOKEN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainSequence) if f.name not in WHOLE_SEQUENCE_FIELDS)[2:]
"""The per-response-token fields of a TrainSequence: what a MicroBatch may hold in `fields`."""


def as_sequence(seq: Union[TrainSequence, Mapping[str, Any]]) -> TrainSequence:
    """A TrainSequence as is; a mapping (a script's `{"prompt_ids": ..., "response_ids": ..., "loss_mask": ...}`)
    as the record with those fields, so a misspelt key fails here (TypeError) instead of being left out.

    >>> as_sequence({"prompt_ids": [1], "response_ids": [2], "loss_mask": torch.ones(1)}).response_ids
    [2]
    """
    return seq if isinstance(seq, TrainSequence) else TrainSequence(**seq)


def _as_long(x) -> torch.Tensor:
    return x.detach().to("cpu", torch.long).reshape(-1) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.long)


def sequence_lengths(seqs: Sequence[TrainSequence]) -> list[int]:
    """len(prompt_ids) + len(response_ids) per sequence (checks that the prompt is not empty)."""
    lengths = []
    for i, s in enumerate(seqs):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p < 1:
            raise ValueError(f"sequence {i} has an empty prompt: response token 0 is predicted from the last "
                             "prompt token, so give every sequence at least one prompt token (SFT: the first token)")
        lengths.append(p + r)
    return lengths


def plan_micro_batches(lengths: Sequence[int], max_tokens_per_micro_batch: int,
                       micro_batch_cost_tokens: Optional[int] = None) -> list[list[int]]:
    """Index lists, longest sequences first, each with rows x longest row <= the budget.

    Among all ways to cut the length-sorted order into consecutive micro-batches within the budget, this takes
    the one with the least `padded tokens + micro_batch_cost_tokens x number of micro-batches` (dynamic
    programming, O(n x rows per micro-batch)). The per-micro-batch charge stands for what a micro-batch costs
    besides its tokens (reading every weight again, kernel launches, a pipeline slot); default: 1/32 of the
    budget. 0 minimises padding alone (down to one row per micro-batch); a large charge gives the fewest
    micro-batches, and among those the least padding.

    >>> plan_micro_batches([3, 9, 4, 8, 2], 16, micro_batch_cost_tokens=0)
    [[1], [3], [2], [0], [4]]
    >>> plan_micro_batches([3, 9, 4, 8, 2], 16, micro_batch_cost_tokens=100)
    [[1], [3], [2, 0, 4]]
    """
    budget = max_tokens_per_micro_batch
    if budget < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {budget}")
    charge = budget // 32 if micro_batch_cost_tokens is None else micro_batch_cost_tokens
    if charge < 0:
        raise ValueError(f"micro_batch_cost_tokens must be >= 0, got {charge}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # deterministic on every rank
    if order and lengths[order[0]] > budget:
        raise ValueError(f"a sequence has {lengths[order[0]]} tokens but max_tokens_per_micro_batch is "
                         f"{budget}: raise the budget to at least max prompt + max response length")
    L = [lengths[i] for i in order]  # descending: row i is the longest of any micro-batch starting at i
    n = len(L)
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest plan for the first j sorted rows
    start = [0] * (n + 1)              # where the last micro-batch of that plan starts
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):
            padded = (j - i) * L[i]
            if padded > budget:
                break
            cost = best[i] + padded + charge
            if cost < best[j]:
                best[j], start[j] = cost, i
    plan, j = [], n
    while j > 0:
        plan.append(order[start[j]: j])
        j = start[j]
    return plan[::-1]


def split_mini_batches(n: int, num_mini_batches: int, seed: Optional[int] = None) -> list[list[int]]:
    """`num_mini_batches` index lists covering range(n) (sizes differ by at most 1), shuffled when `seed` is given.

    A count, not a size: DP ranks holding equal shares take the same number of optimizer steps.

    >>> split_mini_batches(5, 2)
    [[0, 1, 2], [3, 4]]
    """
    if num_mini_batches < 1 or n < num_mini_batches:
        raise ValueError(f"cannot split {n} sequences into {num_mini_batches} mini-batches: use between 1 and "
                         f"{n} mini-batches per DP rank (ppo_mini_batch_size <= the per-rank batch)")
    idx = list(range(n))
    if seed is not None:
        random.Random(seed).shuffle(idx)
    size, extra = divmod(n, num_mini_batches)
    out, start = [], 0
    for k in range(num_mini_batches):
        end = start + size + (k < extra)
        out.append(idx[start:end])
        start = end
    return out


@dataclasses.dataclass
class MicroBatch:
    """One right-padded micro-batch (see the module doc for the layout); rows are `indices` of the input list."""

    indices: list[int]
    input_ids: torch.Tensor       # (b, T) long
    prompt_lens: torch.Tensor     # (b,) long
    response_lens: torch.Tensor   # (b,) long
    response_mask: torch.Tensor   # (b, R) float32
    fields: dict[str, torch.Tensor]
    """The sequences' TOKEN_FIELDS that are set, (b, R) each, 0 past a row's response."""
    # Set by train_step for the mini-batch this micro-batch belongs to (see schedule.py):
    num_loss_tokens: float = 0.0
    """loss-mask tokens in this micro-batch."""
    global_num_loss_tokens: float = 0.0
    """loss-mask tokens in the whole mini-batch, summed over micro-batches and DP ranks."""
    global_num_seqs: int = 0
    """sequences in the whole mini-batch, summed over DP ranks."""
    routed_experts: Optional[torch.Tensor] = None
    """(b, T, moe_layers, topk) the engine's expert ids per input position, -1 on padding (routing replay)."""

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.fields[key]

    def __contains__(self, key: str) -> bool:
        """Whether the sequences had field `key` set; a name that is no TrainSequence field is a KeyError (a
        misspelt `"old_log_probs" in mb` would otherwise be quietly False)."""
        if key not in TOKEN_FIELDS:
            raise KeyError(f"{key!r} is not a TrainSequence field (one of {', '.join(TOKEN_FIELDS)})")
        return key in self.fields

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_padded_tokens(self) -> int:
        """Tokens the model computes: rows x longest row."""
        return int(self.input_ids.numel())

    @property
    def num_real_tokens(self) -> int:
        return int((self.prompt_lens + self.response_lens).sum())

    @property
    def loss_token_weight(self) -> float:
        """This micro-batch's share of the mini-batch's loss tokens: a token-mean over this micro-batch times
        this is its contribution to the token-mean over the whole mini-batch."""
        return self.num_loss_tokens / max(self.global_num_loss_tokens, 1.0)

    def response_positions(self) -> torch.Tensor:
        """(b, R) long: position in input_ids that predicts response token j (prompt_len + j - 1), clamped to a
        valid position on padding (the result there is masked by response_mask)."""
        R = self.response_mask.shape[1]
        j = torch.arange(R, device=self.input_ids.device)
        pos = self.prompt_lens.unsqueeze(1) - 1 + j  # (b, R)
        return pos.clamp(max=self.input_ids.shape[1] - 1)

    def response_rows(self) -> torch.Tensor:
        """(b, R) long: the row of the model's output holding each response position (row i; a packed micro-batch,
        megatron/tree_packing.py, maps several leaves to one row)."""
        return torch.arange(self.num_rows, device=self.input_ids.device).unsqueeze(1).expand_as(self.response_mask)

    def run(self, model_chunk: torch.nn.Module) -> torch.Tensor:
        """The model stage's output for this micro-batch: right-padded, so RoPE positions 0..T-1, causal attention
        (a packed micro-batch passes its positions and mask)."""
        return model_chunk(self.input_ids, None, None)

    def response_targets(self) -> torch.Tensor:
        """(b, R) long: the response token ids, 0 on padding."""
        pos = (self.response_positions() + 1).clamp(max=self.input_ids.shape[1] - 1)
        return torch.gather(self.input_ids, 1, pos) * self.response_mask.long()

    def padded_to(self, multiple: int) -> "MicroBatch":
        """A copy whose input_ids are right-padded to a multiple of `multiple` columns (itself when they are).

        Sequence parallelism splits the sequence over the TP ranks, so its length must divide by TP; the extra
        columns come after every row's last token, where causal attention keeps them from touching real tokens,
        and no response position reaches them.
        """
        T = self.input_ids.shape[1]
        extra = -T % multiple
        if extra == 0:
            return self
        pad = self.input_ids.new_zeros(self.input_ids.shape[0], extra)
        routed = self.routed_experts
        if routed is not None:
            routed = torch.cat([routed, routed.new_full((routed.shape[0], extra, *routed.shape[2:]), -1)], dim=1)
        return dataclasses.replace(self, input_ids=torch.cat([self.input_ids, pad], dim=1), routed_experts=routed)

    def to(self, device) -> "MicroBatch":
        """A copy with every tensor on `device`."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(
            self, input_ids=move(self.input_ids), prompt_lens=move(self.prompt_lens),
            response_lens=move(self.response_lens), response_mask=move(self.response_mask),
            fields={k: move(v) for k, v in self.fields.items()},
            routed_experts=None if self.routed_experts is None else move(self.routed_experts),
        )


def _collate(seqs: Sequence[TrainSequence], indices: list[int], pad_id: int) -> MicroBatch:
    prompts = [_as_long(seqs[i].prompt_ids) for i in indices]
    responses = [_as_long(seqs[i].response_ids) for i in indices]
    b = len(indices)
    T = max(len(p) + len(r) for p, r in zip(prompts, responses))
    R = max(1, max(len(r) for r in responses))
    input_ids = torch.full((b, T), pad_id, dtype=torch.long)
    response_mask = torch.zeros(b, R)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[row, : len(p)] = p
        input_ids[row, len(p): len(p) + len(r)] = r
        response_mask[row, : len(r)] = 1.0

    fields: dict[str, torch.Tensor] = {}
    for key in TOKEN_FIELDS:
        values = [getattr(seqs[i], key) for i in indices]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values):
            raise ValueError(f"field {key!r} is set on some sequences of a micro-batch and not on others: set it on "
                             "all of them (a (b, R) tensor needs a value for every row)")
        values = [torch.as_tensor(v).reshape(-1) for v in values]
        out = torch.zeros((b, R), dtype=values[0].dtype)
        for row, (v, r) in enumerate(zip(values, responses)):
            if v.shape[0] != len(r):
                raise ValueError(f"field {key!r} of sequence {indices[row]} has {v.shape[0]} values but the "
                                 f"response has {len(r)} tokens: per-token fields cover the response only")
            out[row, : len(r)] = v.detach().cpu()
        fields[key] = out
    for row, i in enumerate(indices):
        routed = seqs[i].routed_experts
        if routed is not None and routed.shape[0] != len(prompts[row]) + len(responses[row]):
            raise ValueError(f"routed_experts of sequence {i} has {routed.shape[0]} positions but the sequence has "
                             f"{len(prompts[row]) + len(responses[row])} tokens (prompt + response)")
    return MicroBatch(indices=list(indices), input_ids=input_ids,
                      prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
                      response_lens=torch.tensor([len(r) for r in responses], dtype=torch.long),
                      response_mask=response_mask, fields=fields,
                      routed_experts=collate_routed([seqs[i].routed_experts for i in indices], T))


def collate_routed(routed: Sequence[Optional[torch.Tensor]], T: int) -> Optional[torch.Tensor]:
    """The rows' (n_i, L, K) routed expert ids as one (b, T, L, K) tensor, -1 past each row's end; None when no row
    has them.

    >>> collate_routed([torch.zeros(2, 1, 1, dtype=torch.int16), torch.ones(1, 1, 1, dtype=torch.int16)], 3)[..., 0, 0]
    tensor([[ 0,  0, -1],
            [ 1, -1, -1]], dtype=torch.int16)
    """
    if all(r is None for r in routed):
        return None
    if any(r is None for r in routed):
        raise ValueError("routed_experts is set on some sequences of a micro-batch and not on others (routing "
                         "replay needs the engine's ids for every trajectory)")
    shape = {tuple(r.shape[1:]) for r in routed}
    if len(shape) != 1:
        raise ValueError(f"routed_experts of one micro-batch have different (layers, topk) shapes: {sorted(shape)}")
    out = torch.full((len(routed), T, *shape.pop()), -1, dtype=routed[0].dtype)
    for row, r in enumerate(routed):
        out[row, : r.shape[0]] = r
    return out


def make_micro_batches(seqs: Sequence[Union[TrainSequence, Mapping[str, Any]]], max_tokens_per_micro_batch: int,
                       pad_id: int = 0, micro_batch_cost_tokens: Optional[int] = None) -> list[MicroBatch]:
    """Pack `seqs` by the token budget (see the module doc); tensors stay on the CPU until the worker moves them.
    Mappings are read through `as_sequence`.

    `micro_batch_cost_tokens`: see plan_micro_batches. `pad_id` only fills positions after a row's last token: causal attention keeps them from touching real
    tokens and their outputs are masked, so any valid id works.
    """
    if not seqs:
        return []
    seqs = [as_sequence(s) for s in seqs]
    plan = plan_micro_batches(sequence_lengths(seqs), max_tokens_per_micro_batch, micro_batch_cost_tokens)
    return [_collate(seqs, idx, pad_id) for idx in plan]


def restore_order(per_micro_batch: Sequence[Sequence[Any]], micro_batches: Sequence[MicroBatch]) -> list[Any]:
    """Per-row results grouped by micro-batch -> one list in the order of the sequences given to
    make_micro_batches. `per_micro_batch[k][r]` belongs to row r of micro_batches[k].

    >>> mbs = [MicroBatch([2, 0], *[torch.zeros(2, 1)] * 4, {}), MicroBatch([1], *[torch.zeros(1, 1)] * 4, {})]
    >>> restore_order([["c", "a"], ["b"]], mbs)
    ['a', 'b', 'c']
    """
    n = sum(len(mb.indices) for mb in micro_batches)
    out: list[Any] = [None] * n
    for results, mb in zip(per_micro_batch, micro_batches, strict=True):
        if len(results) != len(mb.indices):
            raise ValueError(f"got {len(results)} results for a micro-batch of {len(mb.indices)} rows")
        for row, i in enumerate(mb.indices):
            out[i] = results[row]
    return out


def padding_share(micro_batches: Sequence[MicroBatch]) -> float:
    """Share of computed tokens that are padding: 1 - real / (sum over micro-batches of rows x longest row)."""
    padded = sum(mb.num_padded_tokens for mb in micro_batches)
    real = sum(mb.num_real_tokens for mb in micro_batches)
    return 1.0 - real / padded if padded else 0.0
