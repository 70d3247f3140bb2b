"""RL algorithms as pure tensor functions, under verl's names and argument order (what Search-R1 users know).

- ``advantages``: GAE, GRPO, RLOO, REINFORCE++ and ``outcome_token_rewards`` (where an outcome reward goes);
- ``losses``: the PPO policy loss (dual clip, low/high clip ranges), the value loss, entropy, ``agg_loss``;
- ``kl``: KL estimators, the fixed/adaptive KL coefficient controllers, KL as a reward penalty;
- ``masked``: masked mean / variance / whitening;
- ``policy_losses``: the policy loss by name (``ppo``, ``gspo``, ``cispo``), one signature for all three;
- ``rollout_correction``: importance weights and masks between the sampling (behaviour) policy and the
  proximal one: token / sequence TIS, MIS, IcePop, geometric-mean mask, and the mismatch KL;
- ``dapo``: overlong reward shaping and filtering, the dynamic-sampling group filter;
- ``llds``: the likelihood-displacement penalty (LLDS) with its response / action gates;
- ``collapse``: says when the likelihood of positive-advantage tokens has fallen too far;
- ``turn_credit``: turn-level advantages for multi-turn search (GiGPO's step groups over anchor states, per-turn
  rewards) added to the outcome advantage.

One rule runs through all of them: a token with loss mask 0 (retrieved ``<information>`` text, padding) is not
an action, so it is excluded from every token-level quantity: policy loss, KL, entropy, value loss, GAE and
return recursions (stepped over, not cut), and every normalisation statistic. Search-R1 applies the mask to the
policy loss only. No config objects and no ``torch.distributed`` here: the trainer reduces across ranks (the
whitening statistics take a ``reduce`` callable that sums over the DP ranks).

Public and stable (``__all__``): each name that verl's ``verl/trainer/ppo/core_algos.py`` also has
(``compute_gae_advantage_return``, ``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_outcome_advantage``, ``compute_policy_loss``, ``compute_value_loss``,
``compute_entropy_loss``, ``agg_loss``, ``kl_penalty``, ``FixedKLController``, ``AdaptiveKLController``) means
what it means there, with verl's argument names and order and return tuples; ``masked_mean`` / ``masked_var`` /
``masked_whiten`` / ``entropy_from_logits`` are verl's ``verl.utils.torch_functional`` names. Where ours differ:
the mask rule above, an optional ``reduce`` for cross-rank statistics, and ``agg_loss(..., denominator=)`` in place
of verl's ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size``. ``apply_kl_penalty`` takes tensors (verl's
takes its DataProto) and ``outcome_token_rewards`` is ours. ``compute_policy_loss_gspo`` / ``_cispo`` (and
``_ppo``, verl's ``_vanilla``) return verl's ``(loss, metrics)`` and take its four leading tensors, but their clip
ranges and options are keyword-only arguments in place of verl's actor config; their metric names carry no
``actor/`` prefix.
"""
from megatron_searchr1.algo.advantages import (
    compute_gae_advantage_return, compute_grpo_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage, outcome_token_rewards,
)
from megatron_searchr1.algo.kl import (
    KL_ESTIMATORS, AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty,
)
from megatron_searchr1.algo.losses import (
    AGG_MODES, agg_loss, compute_entropy_loss, compute_policy_loss, compute_value_loss, entropy_from_logits,
)
from megatron_searchr1.algo.masked import Reduce, masked_mean, masked_moments, masked_sum, masked_var, masked_whiten
from megatron_searchr1.algo.collapse import has_collapsed, likelihood_drop
from megatron_searchr1.algo.dapo import filter_groups, overlong_filter_mask, overlong_penalty
from megatron_searchr1.algo.llds import LLDS_GATES, compute_llds_loss, llds_answer_weight
from megatron_searchr1.algo.policy_losses import (
    POLICY_LOSSES, compute_policy_loss_cispo, compute_policy_loss_gspo, compute_policy_loss_ppo, policy_loss_fn,
)
from megatron_searchr1.algo.rollout_correction import ROLLOUT_CORRECTIONS, compute_rollout_correction, mismatch_kl
from megatron_searchr1.algo.turn_credit import (
    anchor_keys, combine_turn_advantages, step_group_advantages, turn_returns, turn_segments, turn_token_advantages,
)

__all__ = [
    "compute_gae_advantage_return", "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage", "outcome_token_rewards",
    "compute_policy_loss", "compute_value_loss", "agg_loss", "entropy_from_logits", "compute_entropy_loss",
    "AGG_MODES", "kl_penalty", "KL_ESTIMATORS", "FixedKLController", "AdaptiveKLController", "apply_kl_penalty",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten", "masked_moments", "Reduce",
    "POLICY_LOSSES", "policy_loss_fn", "compute_policy_loss_ppo", "compute_policy_loss_gspo",
    "compute_policy_loss_cispo", "ROLLOUT_CORRECTIONS", "compute_rollout_correction", "mismatch_kl",
    "overlong_penalty", "overlong_filter_mask", "filter_groups", "LLDS_GATES", "compute_llds_loss",
    "llds_answer_weight",
    "likelihood_drop", "has_collapsed", "turn_segments", "anchor_keys", "turn_returns", "step_group_advantages",
    "turn_token_advantages", "combine_turn_advantages",
]
