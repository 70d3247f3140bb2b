"""The trainers' data and losses: trajectories and SFT examples as sequences, rewards, advantages, and every loss
callback (actor: PPO / GSPO / CISPO with rollout correction and LLDS; clipped value; SFT NLL).

    seqs = to_sequences(trajs)                                      # TrainSequence records (megatron/batching.py)
    scores = score_trajectories(trajs, tokenizer, cfg.algo)         # EM on the response, routed by data_source
    shape_overlong(trajs, scores, seqs, cfg.algo, max_len)          # DAPO's overlong penalty (in place)
    add_advantages(seqs, scores, cfg.algo, kl_ctrl)                 # advantages/returns (+ token rewards)
    apply_overlong_filter(trajs, seqs, cfg.algo)                    # DAPO's overlong filter: the loss only
    policy.update(mbs, actor_loss_fn(cfg.algo), ...)                # trainer/roles.py -> megatron/schedule.py
    critic.update(mbs, critic_loss_fn(cfg.algo))
    policy.update(mbs, masked_nll_loss, step_scheduler=True)        # SFT, on [sft_sequence(ids, mask), ...]

The per-token arithmetic is algo/'s pure functions; this module lays trajectories out as (B, T) tensors for them and
back, and writes the loss callbacks in the schedule's contract (a micro-batch's contribution to the mini-batch
loss, see megatron/schedule.py). Masks: `loss_mask` is 1 on generated tokens, 0 on observations; every
token-level quantity uses it (algo/__init__.py).

SFT uses the same step. Each example becomes a sequence whose "prompt" is its first token and whose "response" is
the rest (`sft_sequence`), so log-probs cover every token after the first and masked_nll_loss is the token-mean NLL
over the loss-mask tokens. (Keeping the real prompt as the prompt works the same way and skips its log-probs.)
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch

from megatron_searchr1 import algo
from megatron_searchr1.config import AlgoConfig
from megatron_searchr1.megatron.batching import MicroBatch, TrainSequence
from megatron_searchr1.rollout.loop import Trajectory, generated_text


def pad_rows(rows: Sequence[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    """1-D tensors -> (B, T) right-padded with `value`, T = the longest row."""
    T = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), T), value, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out


def unpad_rows(mat: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    return [mat[i, :n].clone() for i, n in enumerate(lengths)]


def to_sequences(trajs: Sequence[Trajectory], drop_search_errors: bool = True) -> list[TrainSequence]:
    """Training sequences; a trajectory that ended in a failed search gets an all-zero loss mask (when asked), since
    its reward says nothing about the policy."""
    seqs = []
    for t in trajs:
        mask = torch.tensor(t.loss_mask, dtype=torch.float32)
        if drop_search_errors and t.finish_reason == "search_error":
            mask = torch.zeros_like(mask)
        seqs.append(TrainSequence(prompt_ids=list(t.prompt_ids), response_ids=list(t.response_ids), loss_mask=mask,
                                  engine_log_probs=torch.tensor(t.logprobs, dtype=torch.float32),
                                  routed_experts=t.routed_experts))  # MoE routing replay
    return seqs


def score_trajectories(trajs: Sequence[Trajectory], tokenizer, cfg: AlgoConfig, agree=None) -> list[dict]:
    """Per trajectory: `score` (the training reward: cfg.reward with cfg.format_score) plus em / subem / f1 for logs.

    Only what the model generated is scored (`generated_text`: loss-mask-1 tokens): not the prompt's example
    answer, not the retrieved documents, not the invalid-action feedback (it spells out ``<answer> and
    </answer>``). reward=judge: the LLM judge (reward/judge.py) scores each `<answer>` against the gold answers;
    `agree(failed) -> any rank failed` (a collective over the callers' ranks) makes every rank raise JudgeDown
    together when the judge failed on any of them, so no rank is left waiting in a collective."""
    from megatron_searchr1.reward import compute_score, extract_solution

    out = []
    texts = [generated_text(tokenizer, t) for t in trajs]
    for t, text in zip(trajs, texts):
        source, truth = t.meta["data_source"], t.meta["ground_truth"]
        kw = {"format_score": cfg.format_score} if cfg.reward in ("em", "subem") else {}
        out.append({"score": float(compute_score(source, text, truth, kind=cfg.reward, **kw))
                    if cfg.reward != "judge" else 0.0,
                    "em": float(compute_score(source, text, truth, kind="em")),
                    "subem": float(compute_score(source, text, truth, kind="subem")),
                    "f1": float(compute_score(source, text, truth, kind="f1"))})
    if cfg.reward == "judge":
        from megatron_searchr1.reward.judge import JudgeDown, judge_for

        judge = judge_for(cfg)
        failure = None
        try:
            verdicts = judge.score([(t.meta.get("question", ""), list(t.meta["ground_truth"].get("target", [])),
                                     extract_solution(text)) for t, text in zip(trajs, texts)])
        except JudgeDown as e:
            failure = e
        if agree is not None and agree(failure is not None) and failure is None:
            failure = JudgeDown(judge.url, 0, 0, "the judge failed on another rank")
        if failure is not None:
            raise failure
        for o, v in zip(out, verdicts):
            o["score"] = o["judge"] = v
    return out


def any_rank(failed: bool) -> bool:
    """True on every rank when `failed` is true on any rank of the default process group (the `agree` of
    score_trajectories for callers that all score together)."""
    import torch.distributed as dist

    from megatron_searchr1.collectives import collective_device

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failed
    flag = torch.tensor([int(failed)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def dp_sum(group=None):
    """An `algo.Reduce` over the ranks of `group` (the DP group): the float64 tensor summed over them.

    On GPUs the tensor goes through the accelerator (`collective_device`, the package's rule for collectives); on
    the CPU it stays there (gloo). With one rank (or no process group) it is returned as is."""
    import torch.distributed as dist

    from megatron_searchr1.collectives import collective_device

    def reduce(t: torch.Tensor) -> torch.Tensor:
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return t
        out = t.to(collective_device(), copy=True)
        dist.all_reduce(out, group=group)
        return out.to(t.device)

    return reduce


def turn_inputs(trajs: Sequence[Trajectory], tokenizer, cfg: AlgoConfig,
                gold_answers: Optional[Sequence[Sequence[str]]] = None) -> Optional[dict]:
    """What algo.turn_credit needs per trajectory, or None when it is off: ``keys`` (the anchor state of each turn,
    algo.turn_credit.anchor_keys over the response's token ids) and ``rewards`` (one per turn, times
    cfg.turn_credit.turn_reward_coef; all 0 with turn_reward none).

    turn_reward ``retrieved_answer``: a turn earns 1 when the observation that follows it (its search's results)
    holds a gold answer that no earlier observation of the trajectory held: the final answer (ground_truth) or,
    where the data carries it (`gold_answers`, e.g. the synthetic world's chain), a hop's answer; normalised as EM
    normalises. ``module:function``: ``function(observations, meta) -> [reward per turn]`` with the observation
    text after each turn ("" for none) and the trajectory's meta (plus ``gold_answers``). Observation tokens are
    decoded only to be read: nothing is re-tokenized."""
    tc = cfg.turn_credit
    if not tc.enabled:
        return None
    keys, rewards = [], []
    fn = None
    if tc.turn_reward not in ("none", "retrieved_answer"):
        import importlib

        module, _, name = tc.turn_reward.partition(":")
        fn = getattr(importlib.import_module(module), name)
    for i, t in enumerate(trajs):
        keys.append(algo.anchor_keys(t.response_ids, t.loss_mask))
        turns, obs = algo.turn_segments(t.loss_mask)
        if tc.turn_reward == "none":
            rewards.append([0.0] * len(turns))
            continue
        texts = [tokenizer.decode(t.response_ids[a:b]) if b > a else "" for a, b in obs]
        golds = list(gold_answers[i]) if gold_answers is not None else []
        if fn is not None:
            r = [float(x) for x in fn(texts, {**t.meta, "gold_answers": golds})]
            if len(r) != len(turns):
                raise ValueError(f"algo.turn_credit.turn_reward={tc.turn_reward} returned {len(r)} rewards for "
                                 f"{len(turns)} turns")
        else:
            r = retrieved_answer_rewards(texts, _targets(t.meta.get("ground_truth")) + golds)
        rewards.append([tc.turn_reward_coef * x for x in r])
    return {"keys": keys, "rewards": rewards}


def _targets(ground_truth) -> list[str]:
    target = (ground_truth or {}).get("target", []) if isinstance(ground_truth, dict) else ground_truth
    if isinstance(target, str):
        return [target]
    return [str(x) for x in (target if target is not None else [])]


def retrieved_answer_rewards(observations: Sequence[str], golds: Sequence[str]) -> list[float]:
    """Per turn, 1.0 when its observation holds (normalised substring) a gold answer that no earlier observation
    held, else 0.0.

    >>> retrieved_answer_rewards(["Orrick is CEO", "nothing", "Orrick again; founded 1856"], ["1856", "Talven Orrick",
    ...                                                                                       "orrick"])
    [1.0, 0.0, 1.0]
    """
    from megatron_searchr1.reward.qa_em import normalize_answer

    wanted = {normalize_answer(g) for g in golds if normalize_answer(g)}
    found: set = set()
    out = []
    for text in observations:
        norm = normalize_answer(text)
        new = {g for g in wanted - found if g in norm}
        found |= new
        out.append(1.0 if new else 0.0)
    return out


def add_advantages(seqs: list[TrainSequence], scores: Sequence[float], group_ids: Sequence[str], cfg: AlgoConfig,
                   kl_ctrl=None, reduce: Optional[algo.Reduce] = None,
                   turns: Optional[dict] = None, trees: Optional[Sequence] = None) -> dict[str, float]:
    """Set `advantages`, `returns` and `token_rewards` (per response token) on each sequence; returns metrics.

    Needs `old_log_probs` (and `ref_log_probs` for KL in the reward, `values` for GAE) already in the sequences.
    A sequence with an all-zero loss mask (a failed search under rollout.drop_search_errors) gets its own group so
    it moves no other sequence's baseline.

    `reduce` sums over the DP ranks (`dp_sum(dp_group)`): GAE and REINFORCE++ whiten over the whole batch, and
    the metrics are the whole batch's, the same keys and values on every rank. Every rank calls it the same
    number of times whatever its data, so a rank whose trajectories were all dropped still takes part.
    `train/dropped_trajectories` counts the batch's sequences without a loss token.

    GRPO / RLOO, a sample left alone in its group (its siblings were dropped; rollout.n >= 2 is enforced, so that
    is the only way): verl gives a group of one mean 0 and std 1 (RLOO: its own score), so its advantage would be
    its raw score, +1 for a right answer and 0 for a wrong one, with no baseline, unlike every other sample's.
    Here it gets advantage 0: with nothing to compare it with, it carries no signal (its tokens still take part
    in the KL and entropy terms). `train/lone_samples` counts them.

    `turns` (`turn_inputs`, algo.turn_credit on): the outcome advantage plus cfg.turn_credit.weight times each
    turn's step advantage (algo/turn_credit.py: GiGPO's step groups over anchor states, the return from the turn
    with its per-turn rewards, outcome = the score).
    tree_grpo (`trees`: each sequence's rollout/tree.py TreeCoords): algo/tree.py's inter- plus intra-tree GRPO, a
    lone group's part 0 as above, each copy of a token shared by c leaves weighted 1/c (`_tree_advantages`).
    """
    lengths = [len(s.response_ids) for s in seqs]
    mask = pad_rows([s.loss_mask for s in seqs])                         # (B, T)
    has_tokens = mask.bool().any(dim=-1)                                  # (B,)
    rewards = algo.outcome_token_rewards(list(scores), mask)              # (B, T)
    metrics: dict[str, float] = {}
    kl_sum = 0.0
    if cfg.use_kl_in_reward:
        rewards, current_kl = algo.apply_kl_penalty(rewards, pad_rows([s.old_log_probs for s in seqs]),
                                                    pad_rows([s.ref_log_probs for s in seqs]), mask, kl_ctrl,
                                                    cfg.kl_penalty)
        kl_sum = current_kl * float(has_tokens.sum())  # current_kl: the mean over rows with tokens
    index = [g if bool(has_tokens[i]) else f"{g}#masked{i}" for i, g in enumerate(group_ids)]
    est = cfg.adv_estimator
    lone: list[int] = []
    if est == "gae":
        adv, ret = algo.compute_gae_advantage_return(rewards, pad_rows([s.values for s in seqs]), mask,
                                                     cfg.gamma, cfg.lam, reduce=reduce)
    elif est in ("grpo", "rloo"):
        if est == "grpo":
            adv, _ = algo.compute_grpo_outcome_advantage(rewards, mask, index,
                                                         norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo)
        else:
            adv, _ = algo.compute_rloo_outcome_advantage(rewards, mask, index)
        size = Counter(index)
        lone = [i for i, g in enumerate(index) if size[g] == 1 and bool(has_tokens[i])]
        adv = adv.clone()
        adv[lone] = 0.0
        if turns is not None:
            tc = cfg.turn_credit
            rets = [algo.turn_returns(sc, rw, tc.gamma) if bool(has_tokens[i]) else []
                    for i, (sc, rw) in enumerate(zip(scores, turns["rewards"]))]
            keys = [k if bool(has_tokens[i]) else [] for i, k in enumerate(turns["keys"])]
            step = algo.step_group_advantages(rets, keys, index, norm_by_std=tc.norm_by_std)
            step_tok = algo.turn_token_advantages(step, mask)                       # (B, T)
            adv = algo.combine_turn_advantages(adv, step_tok, mask, tc.weight)
            n_turns = sum(len(k) for k in keys)
            moved = sum(1 for row in step for v in row if v != 0.0)
            reward_sum = sum(sum(r) for r in turns["rewards"])
            turn_sums = torch.tensor([float(n_turns), float(moved), reward_sum,
                                      float(step_tok[mask.bool()].abs().sum())], dtype=torch.float64)
            if reduce is not None:
                turn_sums = reduce(turn_sums)
            nt, nm, rs, sa = turn_sums.tolist()
            metrics.update({"turn/turns": nt, "turn/moved_frac": nm / max(nt, 1.0),
                            "turn/reward_per_turn": rs / max(nt, 1.0)})
            turn_abs = sa
        ret = adv
    elif est == "tree_grpo":
        adv, lone = _tree_advantages(rewards, mask, has_tokens, index, trees, lengths, cfg)
        ret = adv
    else:
        adv, ret = algo.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, cfg.gamma, reduce=reduce)
    for s, a, r, w in zip(seqs, unpad_rows(adv, lengths), unpad_rows(ret, lengths), unpad_rows(rewards, lengths)):
        s.advantages, s.returns, s.token_rewards = a, r, w
    m = mask.bool()
    sums = torch.tensor([float(adv[m].sum()), float(adv[m].abs().sum()), float(ret[m].sum()), float(m.sum()),
                         float((~has_tokens).sum()), float(len(lone)), kl_sum, float(has_tokens.sum())],
                        dtype=torch.float64)
    if reduce is not None:
        sums = reduce(sums)
    adv_sum, adv_abs, ret_sum, tokens, dropped, n_lone, kl_total, rows = sums.tolist()
    metrics.update({"actor/advantages_mean": adv_sum / max(tokens, 1.0),
                    "actor/advantages_abs_mean": adv_abs / max(tokens, 1.0),
                    "critic/returns_mean": ret_sum / max(tokens, 1.0),
                    "train/dropped_trajectories": dropped, "train/lone_samples": n_lone})
    if cfg.use_kl_in_reward:
        metrics.update({"actor/reward_kl_penalty": kl_total / max(rows, 1.0), "actor/reward_kl_coef": kl_ctrl.value})
    if turns is not None and est in ("grpo", "rloo"):
        metrics["turn/step_adv_abs_mean"] = turn_abs / max(tokens, 1.0)
    return metrics


def _tree_advantages(rewards, mask, has_tokens, index, trees, lengths, cfg: AlgoConfig):
    """Tree-GRPO's advantages (algo/tree.py) over (B, T) `rewards` / `mask`, each copy of a shared token weighted
    1 / (leaves of its tree that hold it and have a loss token); returns (advantages, rows lone in their group)."""
    from megatron_searchr1.algo import tree as tree_algo

    if trees is None or any(c is None for c in trees):
        raise ValueError("algo.adv_estimator=tree_grpo needs tree rollouts: every trajectory's meta['tree'] "
                         "(rollout.tree.trees >= 1)")
    tree_index = [c.tree if bool(has_tokens[i]) else f"{c.tree}#masked{i}" for i, c in enumerate(trees)]
    adv, _, _ = tree_algo.compute_tree_grpo_outcome_advantage(
        rewards, mask, index, tree_index, norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo, single_group_zero=True)
    owners = tree_algo.segment_owners([c.segments for c in trees], lengths)      # (B, T)
    owners[~has_tokens] = -1  # a dropped leaf trains nothing: it takes no share of a token
    weights = tree_algo.shared_token_weights(owners, tree_index, mask)            # (B, T)
    size = Counter(index)
    lone = [i for i, g in enumerate(index) if size[g] == 1 and bool(has_tokens[i])]
    return tree_algo.weighted_advantages(adv, weights), lone


def _weight(mb, mode: str) -> float:
    """This micro-batch's share of the mini-batch loss (megatron/schedule.py's contract).

    token-mean: its share of the mini-batch's loss tokens. seq-mean-*: `agg_loss` averages over the rows of this
    micro-batch that have a loss token, so the share is that row count over the mini-batch's rows (all DP ranks):
    the sum of the micro-batches is then sum(per-row loss) / rows, whatever the packing, with rows that have no
    loss token (dropped trajectories) counted in the denominator as verl counts them (its global_batch_size is
    the mini-batch size)."""
    if mode == "token-mean":
        return mb.loss_token_weight
    rows_with_tokens = int(mb["loss_mask"].bool().any(dim=-1).sum())
    return rows_with_tokens / max(mb.global_num_seqs, 1)


def _policy_loss_kwargs(cfg: AlgoConfig) -> dict:
    """The clip settings of `cfg.policy_loss` (algo.policy_losses' keyword arguments)."""
    if cfg.policy_loss == "gspo":
        return {"clip_ratio_low": cfg.gspo_clip_ratio_low, "clip_ratio_high": cfg.gspo_clip_ratio_high,
                "clip_ratio_c": None}
    if cfg.policy_loss == "cispo":
        return {"clip_ratio_low": cfg.cispo_clip_ratio_low, "clip_ratio_high": cfg.cispo_clip_ratio_high,
                "clip_ratio_c": None}
    low = cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low
    high = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    return {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": cfg.clip_ratio_c}


# Metrics the actor loss reports as totals over the mini-batch (sums and counts), not as token-weighted means of
# micro-batch means: the schedule sums `loss_token_weight * value` over micro-batches and DP ranks, so a value
# divided by its micro-batch's weight comes back as the exact total (`_total`). Trainer.update turns them into
# ratios (`ratio_metrics`).
TOTALS = ("logp_pos_sum", "logp_pos_count", "logp_neg_sum", "logp_neg_count")


def _total(value: torch.Tensor, mb) -> torch.Tensor:
    w = mb.loss_token_weight
    return value / w if w > 0 else torch.zeros_like(value)


def ratio_metrics(sums: dict[str, float], prefix: str = "actor/") -> dict[str, float]:
    """The collapse watch's means from the totals of TOTALS (summed over micro-batches, DP ranks and updates):
    ``logp_pos_mean = logp_pos_sum / logp_pos_count``, and the same for ``neg``; no key at all when the count is 0
    (a step without a positive-advantage token has no value, which the collapse watch skips). The totals are
    removed from `sums`.

    >>> ratio_metrics({"actor/logp_pos_sum": -3.0, "actor/logp_pos_count": 6.0, "actor/logp_neg_sum": 0.0,
    ...                "actor/logp_neg_count": 0.0})
    {'actor/logp_pos_mean': -0.5}
    """
    out = {}
    for side in ("pos", "neg"):
        total = sums.pop(f"{prefix}logp_{side}_sum", 0.0)
        count = sums.pop(f"{prefix}logp_{side}_count", 0.0)
        if count > 0:
            out[f"{prefix}logp_{side}_mean"] = total / count
    return out


def actor_loss_fn(cfg: AlgoConfig, engine_gap: bool = False, max_response_length: Optional[int] = None,
                  llds_answer_coef: Optional[float] = None):
    """The actor loss for Policy.update (schedule.train_step): `cfg.policy_loss` (ppo / gspo / cispo) with the
    rollout correction's weights, + LLDS, + KL to the reference, - entropy bonus.

    Micro-batches without `old_log_probs` are on-policy (the step's only update, see Trainer.on_policy): the
    model has not moved since the rollout, so the old log-probs are this forward's own, detached. With
    `engine_gap` such a pass also reports `logprob_gap_engine` (logprob_gap, from this forward).

    Rollout correction: behaviour = the engine's log-probs (`engine_log_probs`, what sampled the tokens), proximal
    = `old_log_probs` (the trainer's, before this step's first update). Both are fixed for the whole step, so the
    weights are the same in every epoch and mini-batch (ppo_epochs > 1 is right); masked tokens get weight 0 but
    keep their place in the denominator, so the micro-batch shares (`_weight`) still add up. The masked modes'
    rejection mask applies to every term (policy loss, KL, entropy, LLDS): a rejected token trains nothing. `rc_*`
    metrics measure the gap whichever mode is set. `max_response_length` is seq-mean-token-sum-norm's constant.

    Aggregation: each term with its own micro-batch share. GSPO's policy loss is seq-mean-token-mean whatever
    `cfg.loss_agg_mode` (the paper's and verl's); the KL, entropy and LLDS terms use `cfg.loss_agg_mode`.
    `llds_answer_coef` replaces `cfg.llds.answer_coef` (the adaptive weight of this step, Trainer.update).

    Metrics are means over micro-batches (so `*_min` / `*_max` are means of per-micro-batch extremes), except the
    TOTALS, which are exact sums (see `ratio_metrics`)."""
    pg_fn = algo.policy_loss_fn(cfg.policy_loss)
    pg_kw = _policy_loss_kwargs(cfg)
    mode = cfg.loss_agg_mode
    pg_mode = "seq-mean-token-mean" if cfg.policy_loss == "gspo" else mode
    norm = mode == "seq-mean-token-sum-norm"
    scale = float(max_response_length) if norm and max_response_length else None
    # "auto" is resolved by Config (by placement); an AlgoConfig on its own is a colocated one: none
    rc_mode = "none" if cfg.rollout_correction == "auto" else cfg.rollout_correction
    masking = rc_mode in ("token_mis", "seq_mis", "icepop", "geo_mask")
    answer_coef = cfg.llds.answer_coef if llds_answer_coef is None else llds_answer_coef

    def agg(mat, mask, keep):
        # rejected tokens contribute 0 but keep their place in the denominator (as in the policy loss)
        return algo.agg_loss(torch.where(keep, mat, 0.0), mask, mode, loss_scale_factor=scale)

    def loss_fn(outputs: dict, mb):
        mask = mb["loss_mask"]                                                   # (b, R)
        log_prob = outputs["log_probs"]                                          # (b, R)
        adv = mb["advantages"]                                                   # (b, R)
        on_policy = "old_log_probs" not in mb
        old_log_prob = log_prob.detach() if on_policy else mb["old_log_probs"]  # (b, R) the proximal policy
        metrics = {}
        weights = None
        keep = mask.bool()                                                       # (b, R)
        if "engine_log_probs" in mb:
            w, rc_keep, rc = algo.compute_rollout_correction(
                old_log_prob.detach(), mb["engine_log_probs"], mask, rc_mode,
                cap=cfg.rollout_correction_cap, low=cfg.rollout_correction_low, high=cfg.rollout_correction_high)
            metrics.update({f"rc_{k}": v for k, v in rc.items()})
            if rc_mode != "none":
                weights = w                                                      # (b, R) detached, 0 if masked
            if masking:
                keep = rc_keep
        pg_loss, pm = pg_fn(old_log_prob, log_prob, adv, mask, loss_agg_mode=pg_mode,
                            rollout_is_weights=weights, loss_scale_factor=scale, **pg_kw)
        loss = pg_loss * _weight(mb, pg_mode)
        other = torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)  # terms aggregated under `mode`
        metrics.update({"pg_loss": pg_loss, f"pg_loss_{cfg.policy_loss}": pg_loss, **pm})
        # LLDS: its metrics (old log-prob of positive / negative-advantage tokens, gate shares) are logged always;
        # the penalty joins the loss only when it is on. sum-norm: the row sums over the run's constant.
        # A rejected token (masked modes) is held at its old log-prob here: no fall, no penalty, no gradient.
        llds_mode = "seq-mean-token-sum" if norm else mode
        llds_lp = torch.where(keep, log_prob, old_log_prob.detach()) if masking else log_prob    # (b, R)
        penalty, lm = algo.compute_llds_loss(old_log_prob, llds_lp, adv, mask, coef=cfg.llds.coef,
                                             gate=cfg.llds.gate, answer_coef=answer_coef, loss_agg_mode=llds_mode)
        if norm:
            penalty = penalty / (scale if scale else mask.shape[-1])
        lm["llds_penalty"] = penalty.detach()
        if cfg.llds.enabled:
            other = other + penalty
        for k in TOTALS:
            lm[k] = _total(lm[k], mb)
        for side in ("pos", "neg"):  # the step's means come from the totals (ratio_metrics), not from these
            lm.pop(f"logp_{side}_mean")
        metrics.update(lm)
        if on_policy and engine_gap and "engine_log_probs" in mb:
            gap, tokens = _gap_sums(mb["engine_log_probs"], log_prob.detach(), mask)
            metrics["logprob_gap_engine"] = gap / tokens.clamp(min=1.0)
        if "entropy" in outputs:  # detached at entropy_coeff 0 (Trainer.update: entropy_grad), then only a metric
            entropy = agg(outputs["entropy"], mask, keep)
            if cfg.entropy_coeff != 0:
                other = other - cfg.entropy_coeff * entropy
            metrics["entropy"] = entropy
        if cfg.use_kl_loss:
            kl = agg(algo.kl_penalty(log_prob, mb["ref_log_probs"], cfg.kl_loss_type), mask, keep)
            other = other + cfg.kl_loss_coef * kl
            metrics["kl_loss"] = kl
        loss = loss + other * _weight(mb, mode)
        return loss, {k: v.detach() for k, v in metrics.items()}

    return loss_fn


def overlong_scores(trajs: Sequence[Trajectory], scores: Sequence[dict], cfg: AlgoConfig,
                    max_response_length: int) -> list[float]:
    """The training scores with DAPO's overlong penalty added (`cfg.overlong_buffer` > 0; over the response length
    the budget counts, observations included); the scores themselves are left alone."""
    values = [float(sc["score"]) for sc in scores]
    if cfg.overlong_buffer <= 0 or not values:
        return values
    lengths = torch.tensor([len(t.response_ids) for t in trajs], dtype=torch.float32)
    pen = algo.overlong_penalty(lengths, max_response_length, cfg.overlong_buffer, cfg.overlong_penalty)
    return [v + p for v, p in zip(values, pen.tolist())]


def overlong_truncated(trajs: Sequence[Trajectory], cfg: AlgoConfig) -> list[bool]:
    """Per trajectory, whether DAPO's overlong filter masks its loss (`cfg.overlong_filter` and the budget cut it)."""
    return [bool(cfg.overlong_filter) and t.finish_reason == "length" for t in trajs]


def shape_overlong(trajs: Sequence[Trajectory], scores: list[dict], seqs: list[TrainSequence], cfg: AlgoConfig,
                   max_response_length: int) -> dict[str, float]:
    """DAPO's overlong shaping, in place on the scores: `cfg.overlong_buffer` > 0 adds algo.overlong_penalty to each
    score (`overlong_scores`). The overlong *filter* is not applied here: the truncated trajectories keep their
    reward in their groups' statistics and lose only their loss, after the advantages (`apply_overlong_filter`).
    Returns this rank's metrics."""
    metrics: dict[str, float] = {}
    if cfg.overlong_buffer > 0:
        shaped = overlong_scores(trajs, scores, cfg, max_response_length)
        pens = [v - float(sc["score"]) for v, sc in zip(shaped, scores)]
        for sc, v in zip(scores, shaped):
            sc["score"] = v
        metrics["train/overlong_penalty_mean"] = sum(pens) / len(pens) if pens else 0.0
    if cfg.overlong_filter:
        metrics["train/overlong_filtered"] = float(sum(overlong_truncated(trajs, cfg)))
    return metrics


def apply_overlong_filter(trajs: Sequence[Trajectory], seqs: list[TrainSequence], cfg: AlgoConfig) -> None:
    """DAPO's overlong filter, after `add_advantages`: the loss mask of each trajectory the budget cut set to 0
    (algo.overlong_filter_mask), so it trains nothing while its reward has already counted in its group."""
    cut = overlong_truncated(trajs, cfg)
    if not any(cut):
        return
    for s, c in zip(seqs, cut):
        if c:
            s.loss_mask = algo.overlong_filter_mask(s.loss_mask.reshape(1, -1), torch.tensor([True])).reshape(-1)


def critic_loss_fn(cfg: AlgoConfig):
    """Clipped value loss for Critic.update (outputs["values"]: (b, R))."""

    def loss_fn(outputs: dict, mb):
        vf_loss, vf_clipfrac = algo.compute_value_loss(outputs["values"], mb["returns"], mb["values"],
                                                       mb["loss_mask"], cfg.cliprange_value, cfg.loss_agg_mode)
        return vf_loss * _weight(mb, cfg.loss_agg_mode), {"vf_loss": vf_loss.detach(),
                                                          "vf_clipfrac": vf_clipfrac.detach()}

    return loss_fn


def logprob_gap(seqs: Sequence[TrainSequence]) -> float:
    """Mean |engine log-prob - trainer log-prob| over generated tokens: how far the rollout engine's numbers are
    from the trainer's on the same tokens (weight sync, precision, kernels)."""
    num, den = 0.0, 0.0
    for s in seqs:
        gap, tokens = _gap_sums(s.engine_log_probs, s.old_log_probs, s.loss_mask)
        num, den = num + float(gap), den + float(tokens)
    return num / max(den, 1.0)


def _gap_sums(engine_log_probs: torch.Tensor, log_probs: torch.Tensor, mask: torch.Tensor):
    """(sum of |engine - trainer| over the masked tokens, their count): one formula for logprob_gap and for the
    on-policy update's own report."""
    m = mask.to(log_probs.dtype)
    return ((engine_log_probs - log_probs).abs() * m).sum(), m.sum()


def sft_sequence(token_ids, loss_mask) -> TrainSequence:
    """One SFT example as a training sequence: prompt = the first token, response = the rest (with its mask).

    >>> s = sft_sequence([5, 6, 7], [0, 1, 1]); s.prompt_ids, s.response_ids, s.loss_mask.tolist()
    ([5], [6, 7], [1.0, 1.0])
    """
    ids = [int(t) for t in token_ids]
    mask = torch.as_tensor(loss_mask, dtype=torch.float32).reshape(-1)
    if len(ids) < 2 or mask.numel() != len(ids):
        raise ValueError(f"an SFT example needs >= 2 tokens and one mask value per token (got {len(ids)} tokens, "
                         f"{mask.numel()} mask values)")
    return TrainSequence(prompt_ids=ids[:1], response_ids=ids[1:], loss_mask=mask[1:])


def masked_nll_loss(outputs: dict, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
    """SFT loss_fn: -log p over the loss-mask tokens, this micro-batch's share of the mini-batch token-mean."""
    mask = mb["loss_mask"]  # (b, R)
    nll = -(outputs["log_probs"] * mask).sum()
    return nll / max(mb.global_num_loss_tokens, 1.0), {"nll": nll.detach() / mask.sum().clamp(min=1)}
