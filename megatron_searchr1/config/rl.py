"""The RL run's schema: one dataclass per section, a one-line docstring per field.

Sections: data, model, parallel, rollout, retrieval (those two in rl_rollout.py), algo, optim, trainer, logging.
Every field has a one-line docstring (`python -m megatron_searchr1.train --help-config` prints them). Each section
checks itself in `__post_init__`; `Config.validate()` checks what spans sections and the files the run needs,
cheaply (config.json is read as JSON, no model is built), so a bad config fails in a second with a message that
says what to change. The resolved config is written to `<trainer.output_dir>/config.yaml`.

Names follow Search-R1 / verl where a user would look for them (`rollout.n`, `algo.adv_estimator`,
`algo.kl_loss_coef`, `data.train_batch_size`), so its users can carry their launch lines over.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from megatron_searchr1.config.finetune import FreezeSettings, LoraSettings
from megatron_searchr1.config.layout import LayoutError, check_engine_layout, no_cuda_reason
from megatron_searchr1.config.loader import ConfigError, check
from megatron_searchr1.config.rl_rollout import RetrievalConfig, RolloutConfig  # noqa: F401 (importable from here)

ESTIMATORS = ("grpo", "gae", "rloo", "reinforce_plus_plus", "tree_grpo")
KL_KINDS = ("kl", "abs", "mse", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
ROLLOUT_CORRECTIONS = ("none", "token_tis", "seq_tis", "token_mis", "seq_mis", "icepop", "geo_mask", "auto")
LLDS_GATES = ("action", "response")
PLACEMENTS = ("colocated", "disaggregated")


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Search-R1 parquet files for training (prompt, data_source, reward_model.ground_truth, extra_info.uid)."""
    val_files: list[str] = field(default_factory=list)
    """Parquet files for validation (EM per data_source)."""
    train_batch_size: int = 8
    """Prompts per step over all DP ranks (each is sampled rollout.n times)."""
    val_batch_size: int = 64
    """Prompts per validation generate batch per DP rank."""
    val_max_samples: Optional[int] = None
    """Validate on the first N rows of each validation file (None = all)."""
    max_prompt_length: int = 512
    """Prompts longer than this (in tokens, after rendering) are dropped at load time, with a count; never cut."""
    chat_template: str = "auto"
    """auto: the tokenizer's chat template when it has one (Search-R1's rule); always; never (raw prompt text)."""
    shuffle: bool = True
    """Shuffle the training rows every epoch (seeded by trainer.seed and the epoch)."""

    def __post_init__(self):
        check(self.train_batch_size >= 1, f"data.train_batch_size must be >= 1, got {self.train_batch_size}")
        check(self.val_batch_size >= 1, f"data.val_batch_size must be >= 1, got {self.val_batch_size}")
        check(self.max_prompt_length >= 8, f"data.max_prompt_length must be >= 8, got {self.max_prompt_length}")
        check(self.chat_template in ("auto", "always", "never"),
              f"data.chat_template must be auto, always or never, got {self.chat_template!r}")


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank r (LLaMA-Factory's lora_rank); 0 = off (full-parameter RL). On: the actor trains adapters only."""
    alpha: Optional[float] = None
    """Adapter scale numerator: a layer adds (alpha / rank) * B A x. None = 2 * rank (LLaMA-Factory's default)."""
    dropout: float = 0.0
    """Dropout on the adapters' input in the update's forward (lora_dropout); 0 keeps that forward equal to the
    rollout's and the reference's, which the on-policy ratio and the engine log-prob gap assume."""
    targets: list[str] = field(default_factory=lambda: ["all"])
    """HF module names to adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or [all]."""

    def __post_init__(self):
        if isinstance(self.targets, str):  # "q_proj,v_proj" as LLaMA-Factory writes lora_target
            self.targets = [t.strip() for t in self.targets.split(",") if t.strip()]
        check(self.rank >= 0, f"model.lora.rank must be >= 0 (0 = no LoRA), got {self.rank}")
        if self.enabled:
            try:
                self.settings()
            except ValueError as e:
                raise ConfigError(f"model.{e}: change model.lora.alpha / dropout / targets") from None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def settings(self) -> LoraSettings:
        """The LoraSettings (config/finetune.py) of an enabled config: what models/lora.py applies."""
        return LoraSettings(rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=tuple(self.targets))


@dataclass
class FreezeConfig:
    trainable_layers: Optional[int] = None
    """Freeze fine-tuning (LLaMA-Factory's freeze_trainable_layers): N > 0 trains the last N decoder layers, N < 0
    the first |N|, 0 only the extra modules; None = off. SFT only (config/finetune.py says which parameters train)."""
    trainable_modules: list[str] = field(default_factory=lambda: ["all"])
    """Within the trainable layers: all, or some of self_attn, mlp, input_layernorm, post_attention_layernorm."""
    extra_modules: list[str] = field(default_factory=list)
    """Non-layer modules that train too: some of embed_tokens, norm, lm_head (freeze_extra_modules)."""

    def __post_init__(self):
        for name in ("trainable_modules", "extra_modules"):  # "mlp,self_attn" as LLaMA-Factory writes them
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [t.strip() for t in value.split(",") if t.strip()])
        if self.enabled:
            try:
                self.settings()
            except ValueError as e:
                raise ConfigError(f"model.{e}: change model.freeze.trainable_layers / trainable_modules / "
                                  "extra_modules") from None

    @property
    def enabled(self) -> bool:
        return self.trainable_layers is not None

    def settings(self) -> FreezeSettings:
        """The FreezeSettings (config/finetune.py) of an enabled config: what models/freeze.py applies."""
        return FreezeSettings(trainable_layers=self.trainable_layers, trainable_modules=tuple(self.trainable_modules),
                              extra_modules=tuple(self.extra_modules))


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face model dir of the actor (config, tokenizer; weights unless megatron_ckpt is given)."""
    megatron_ckpt: Optional[str] = None
    """Start the actor (and reference) from this Megatron checkpoint instead (e.g. the SFT output's actor dir)."""
    critic_path: Optional[str] = None
    """HF dir or Megatron checkpoint to start the critic trunk from (None = the actor's start); GAE only."""
    dtype: str = "float32"
    """Training parameter dtype: float32 (CPU) or bfloat16 (GPU, fp32 master weights in the optimizer)."""
    use_te: Optional[bool] = None
    """Transformer Engine layers: None = when available (GPU), False = Megatron's local spec."""
    recompute: str = "none"
    """Activation recomputation in the update: none, selective (attention core, Megatron's default on GPUs) or
    full (every layer's input is kept, the layer recomputed in backward)."""
    param_offload: bool = False
    """Move the actor's (and critic's) parameters to host memory while the engine generates (GPU only)."""
    grad_offload: bool = False
    """Move the gradient buffers to host memory while the engine generates (GPU only)."""
    optimizer_offload: bool = False
    """Move the optimizer states to host memory while the engine generates (GPU only)."""
    ref_offload: bool = False
    """Move the reference model to host memory while vLLM generates, back before its forward pass (GPU only)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA RL: adapters on the actor (rank > 0); the reference is the same model with its adapters off."""
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    """Freeze fine-tuning (SFT): only some decoder layers' (and extra modules') real weights train."""

    def __post_init__(self):
        check(self.dtype in ("float32", "bfloat16", "float16"),
              f"model.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        check(self.recompute in ("none", "selective", "full"),
              f"model.recompute must be none, selective or full, got {self.recompute!r}")
        if self.lora.enabled:
            check(self.use_te is not True,
                  "model.lora needs Megatron's local layers (Transformer Engine fuses the norm into the linears the "
                  "adapters wrap): set model.use_te=false (or leave it null) or model.lora.rank=0")
            check(not self.ref_offload,
                  "model.ref_offload has nothing to move with model.lora: the reference is the actor with its "
                  "adapters off, not a second model; set model.ref_offload=false")
        check(not (self.lora.enabled and self.freeze.enabled),
              "model.lora and model.freeze are two fine-tuning types (LLaMA-Factory's finetuning_type lora / "
              "freeze): set model.lora.rank=0 or model.freeze.trainable_layers=null")


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size of the actor/critic/reference (Megatron)."""
    pp: int = 1
    """Pipeline-parallel size; DP = world size / (tp * pp)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP ranks (Megatron's distributed optimizer)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations outside attention/MLP split over TP ranks (needs tp > 1)."""
    timeout_minutes: int = 30
    """Collective timeout (NCCL / gloo): a rank that waits longer than this fails instead of hanging."""
    ep: int = 1
    """Expert-parallel size (MoE models): each MoE layer's experts split over `ep` ranks of a data-parallel group;
    must divide the number of experts and the world size / (tp * pp)."""
    expert_tp: Optional[int] = None
    """Expert tensor-parallel size (MoE models; Megatron's expert_tensor_parallel_size): each routed expert's linears
    split over this many ranks; null = 1 (whole experts per rank, spread by `ep`, as slime runs Qwen3-30B-A3B).
    Must divide moe_intermediate_size; the world must be a multiple of expert_tp * pp * ep. Dense models ignore it."""
    rollout_placement: str = "colocated"
    """colocated: every rank trains and generates, in turn (synchronous steps). disaggregated: the last
    `rollout_ranks` ranks only generate (vLLM), the others only train, both at once (trainer/async_rl.py)."""
    rollout_ranks: int = 0
    """Disaggregated placement: how many of the world's ranks (the last ones) only generate; tp / pp / DP apply to
    the other ranks (Config.trainer_world)."""
    bridge_backend: str = "auto"
    """Disaggregated placement: how the weight buckets go from trainer rank 0 to the rollout ranks: gloo (host
    memory over sockets, the tested path), nccl (GPU to GPU broadcasts; opt-in, not yet run on a GPU), auto (gloo
    on every device until a GPU run of nccl passes). Control messages always go over gloo (rollout/remote_sync.py)."""

    def __post_init__(self):
        check(self.tp >= 1 and self.pp >= 1, f"parallel.tp and parallel.pp must be >= 1, got {self.tp}, {self.pp}")
        check(self.ep >= 1, f"parallel.ep must be >= 1, got {self.ep}")
        check(self.expert_tp is None or self.expert_tp >= 1,
              f"parallel.expert_tp must be >= 1 (or null: 1 for MoE models), got {self.expert_tp}")
        check(self.timeout_minutes >= 1, f"parallel.timeout_minutes must be >= 1, got {self.timeout_minutes}")
        check(self.rollout_placement in PLACEMENTS,
              f"parallel.rollout_placement must be colocated or disaggregated, got {self.rollout_placement!r}")
        check(self.rollout_ranks >= 0, f"parallel.rollout_ranks must be >= 0, got {self.rollout_ranks}")
        check(self.bridge_backend in ("auto", "gloo", "nccl"),
              f"parallel.bridge_backend must be auto, gloo or nccl, got {self.bridge_backend!r}")
        if self.rollout_placement == "disaggregated":
            check(self.rollout_ranks >= 1, "parallel.rollout_placement=disaggregated needs parallel.rollout_ranks "
                                           ">= 1 (how many ranks only generate)")
        else:
            check(self.rollout_ranks == 0, f"parallel.rollout_ranks={self.rollout_ranks} is for "
                                           "parallel.rollout_placement=disaggregated: set it, or rollout_ranks=0")
        check(not self.sequence_parallel or self.tp > 1,
              f"parallel.sequence_parallel needs parallel.tp > 1 (it splits activations over TP ranks), got "
              f"tp={self.tp}: set parallel.sequence_parallel=false or raise parallel.tp")

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world size / (tp * pp); a ConfigError with the torchrun line to use when it does not divide."""
        mp = self.tp * self.pp
        check(world_size % mp == 0,
              f"world size {world_size} is not a multiple of parallel.tp * parallel.pp = {mp}: launch "
              f"`torchrun --nproc_per_node {mp}` (or a multiple), or change parallel.tp / parallel.pp")
        check(world_size % (mp * self.ep) == 0,
              f"world size {world_size} is not a multiple of parallel.tp * parallel.pp * parallel.ep = "
              f"{mp * self.ep}: launch `torchrun --nproc_per_node {mp * self.ep}` (or a multiple), or lower "
              f"parallel.ep")
        etp = self.expert_tp or 1
        check(world_size % (etp * self.pp * self.ep) == 0,
              f"world size {world_size} is not a multiple of parallel.expert_tp * parallel.pp * parallel.ep = "
              f"{etp * self.pp * self.ep}: lower parallel.expert_tp")
        return world_size // mp


@dataclass
class LLDSConfig:
    coef: float = 0.0
    """LLDS penalty weight (arXiv 2512.04220) on likelihood falls of advantage >= 0 tokens; 0 = off."""
    gate: str = "action"
    """Where the penalty's gate opens: action (per generated span between retrievals, the paper's best) or response."""
    answer_coef: Optional[float] = None
    """Weight on the answer span (each response's last action), capped at coef as the reference does; None = coef."""
    answer_adaptive: bool = False
    """The reference's adaptive answer weight: answer_coef x max(mean searches per trajectory - 1, 0), then <= coef."""

    def __post_init__(self):
        check(self.coef >= 0, f"algo.llds.coef must be >= 0 (0 = off), got {self.coef}")
        check(self.gate in LLDS_GATES, f"algo.llds.gate must be action or response, got {self.gate!r}")
        check(self.answer_coef is None or 0 <= self.answer_coef <= self.coef,
              f"algo.llds.answer_coef must be in [0, algo.llds.coef={self.coef}] or null (= coef): the answer's weight "
              f"is min(answer_coef, coef), as in the LLDS reference; got {self.answer_coef}")
        check(not self.answer_adaptive or self.answer_coef is not None,
              "algo.llds.answer_adaptive scales algo.llds.answer_coef: set answer_coef too")

    @property
    def enabled(self) -> bool:
        return self.coef > 0


TURN_REWARDS = ("none", "retrieved_answer")


@dataclass
class TurnCreditConfig:
    weight: float = 0.0
    """Weight of the turn-level (step) advantage added to the outcome advantage (GiGPO's 1.0); 0 = off."""
    gamma: float = 0.95
    """Discount of the return from a turn on (GiGPO's 0.95): later rewards count less for earlier turns."""
    norm_by_std: bool = True
    """Divide a step group's advantages by its std (GiGPO's mean_std_norm); false: mean only."""
    turn_reward: str = "none"
    """Per-turn reward: none, retrieved_answer (the turn's search returned the gold answer), or module:function."""
    turn_reward_coef: float = 0.1
    """Scale of the per-turn reward (added per turn, before the return)."""

    def __post_init__(self):
        check(self.weight >= 0, f"algo.turn_credit.weight must be >= 0 (0 = off), got {self.weight}")
        check(0 <= self.gamma <= 1, f"algo.turn_credit.gamma must be in [0, 1], got {self.gamma}")
        check(self.turn_reward in TURN_REWARDS or ":" in self.turn_reward,
              f"algo.turn_credit.turn_reward must be none, retrieved_answer or module:function, got "
              f"{self.turn_reward!r}")

    @property
    def enabled(self) -> bool:
        return self.weight > 0


@dataclass
class AlgoConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, gae (PPO with a critic), rloo, reinforce_plus_plus, tree_grpo (Tree-GRPO: needs
    rollout.tree)."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group's std (Dr.GRPO sets false)."""
    clip_ratio: float = 0.2
    """PPO clip range."""
    clip_ratio_low: Optional[float] = None
    """Lower clip range (None = clip_ratio)."""
    clip_ratio_high: Optional[float] = None
    """Upper clip range (None = clip_ratio; DAPO's clip-higher uses e.g. 0.28)."""
    clip_ratio_c: Optional[float] = 3.0
    """Dual-clip constant for negative advantages (None = off); PPO's policy loss only (gspo / cispo have none)."""
    cliprange_value: float = 0.5
    """Value clip range (critic)."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean (GSPO's) or seq-mean-token-sum-norm (Dr.GRPO's)."""
    policy_loss: str = "ppo"
    """Policy loss: ppo (token clip), gspo (sequence-level ratio and clip) or cispo (clipped detached IS weight)."""
    gspo_clip_ratio_low: float = 3e-4
    """GSPO's lower clip range on the sequence ratio (the GSPO paper: 3e-4)."""
    gspo_clip_ratio_high: float = 4e-4
    """GSPO's upper clip range on the sequence ratio (the GSPO paper: 4e-4)."""
    cispo_clip_ratio_low: Optional[float] = None
    """CISPO's lower bound on the IS weight, 1 - this (None = no lower bound, as MiniMax-M1)."""
    cispo_clip_ratio_high: float = 5.0
    """CISPO's upper bound on the IS weight, 1 + this (SkyRL's 5: a tight cap would damp the tokens CISPO keeps)."""
    rollout_correction: str = "auto"
    """Engine-vs-trainer correction: auto (none colocated, token_tis disaggregated), none, token_tis, seq_tis,
    token_mis, seq_mis, icepop or geo_mask."""
    rollout_correction_cap: float = 2.0
    """Truncation cap of the TIS weights (and the MIS upper bound when rollout_correction_high is null)."""
    rollout_correction_low: Optional[float] = None
    """Lower end of the MIS / IcePop / geo_mask band (None = the mode's default: 1/high, 0.5, 0.999)."""
    rollout_correction_high: Optional[float] = None
    """Upper end of the MIS / IcePop / geo_mask band (None = the mode's default: cap, 2, 1.001)."""
    routing_replay: bool = False
    """MoE models: the trainer's routers take the experts the vLLM engine chose per token (old-log-prob, reference
    and update forwards; megatron/routing_replay.py). Needed for algo.llds on MoE."""
    llds: LLDSConfig = field(default_factory=LLDSConfig)
    """LLDS, the lazy-likelihood-displacement regulariser (coef 0 = off)."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal, generate more until the batch is full."""
    gen_batches_per_round: int = 3
    """filter_groups: prompt batches (of data.train_batch_size) drawn per generate round (verl-recipe DAPO: 3)."""
    max_gen_batches: int = 10
    """Most generate rounds of one step under filter_groups (verl-recipe DAPO: 10); then train on fewer groups."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: linear penalty over the last N tokens of rollout.max_response_length (0 = off)."""
    overlong_penalty: float = 1.0
    """Largest overlong penalty (reached at the response budget), subtracted from the score."""
    overlong_filter: bool = False
    """DAPO overlong filtering: trajectories the response budget cut get no loss tokens (their reward stays)."""
    turn_credit: TurnCreditConfig = field(default_factory=TurnCreditConfig)
    """Turn-level credit (GiGPO-style step groups, per-turn rewards) added to the outcome advantage; weight 0 = off."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight in the actor loss."""
    use_kl_loss: bool = True
    """KL to the reference as a loss term (Search-R1's GRPO recipe)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss: kl, abs, mse, low_var_kl."""
    use_kl_in_reward: bool = False
    """KL as a per-token reward penalty instead (Search-R1's PPO recipe)."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty."""
    kl_ctrl: str = "fixed"
    """fixed or adaptive KL coefficient for the reward penalty."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient for the reward penalty."""
    target_kl: float = 0.1
    """Adaptive controller target."""
    kl_horizon: int = 10000
    """Adaptive controller horizon."""
    ppo_epochs: int = 1
    """Passes over each step's data."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step (times rollout.n trajectories), over all DP ranks."""
    reward: str = "em"
    """em (exact match, Search-R1's) or subem / f1, routed by data_source; or judge (an LLM judge, algo.judge_*:
    reward/judge.py)."""
    judge_url: str = ""
    """reward=judge: the judge's OpenAI-compatible server root (e.g. vLLM's api_server, http://127.0.0.1:8001)."""
    judge_model: str = "judge"
    """reward=judge: the model name the judge's server serves (--served-model-name)."""
    judge_prompt: str = ""
    """reward=judge: a file holding the prompt template ({question}, {gold}, {prediction}); empty = the built-in."""
    judge_timeout: float = 60.0
    """reward=judge: seconds per judge request."""
    judge_max_retries: int = 2
    """reward=judge: retries of a request that fails or answers neither yes nor no; then the run stops (exit 3)."""
    judge_guided: bool = True
    """reward=judge: constrain the verdict to yes/no with vLLM's structured outputs (false for other servers)."""
    format_score: float = 0.0
    """Reward for a well-formed response with a wrong answer (Search-R1's format_score)."""

    def __post_init__(self):
        check(self.adv_estimator in ESTIMATORS,
              f"algo.adv_estimator must be one of {', '.join(ESTIMATORS)}, got {self.adv_estimator!r}")
        check(self.kl_loss_type in KL_KINDS and self.kl_penalty in KL_KINDS,
              f"algo.kl_loss_type / algo.kl_penalty must be one of {', '.join(KL_KINDS)}")
        check(self.kl_ctrl in ("fixed", "adaptive"), f"algo.kl_ctrl must be fixed or adaptive, got {self.kl_ctrl!r}")
        check(self.loss_agg_mode in LOSS_AGG_MODES, f"algo.loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}")
        check(0 < self.clip_ratio < 1, f"algo.clip_ratio must be in (0, 1), got {self.clip_ratio}")
        check(self.clip_ratio_c is None or self.clip_ratio_c > 1, "algo.clip_ratio_c must be > 1 (or null)")
        check(self.ppo_epochs >= 1 and self.ppo_mini_batch_size >= 1,
              "algo.ppo_epochs and algo.ppo_mini_batch_size must be >= 1")
        check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algo.gamma and algo.lam must be in [0, 1]")
        check(self.reward in ("em", "subem", "f1", "judge"),
              f"algo.reward must be em, subem, f1 or judge, got {self.reward!r}")
        check(self.reward != "judge" or bool(self.judge_url),
              "algo.reward=judge needs algo.judge_url (the judge's OpenAI-compatible server, e.g. http://127.0.0.1:8001)")
        check(self.judge_timeout > 0 and self.judge_max_retries >= 0,
              "algo.judge_timeout must be > 0 and algo.judge_max_retries >= 0")
        check(not (self.use_kl_loss and self.use_kl_in_reward),
              "choose one of algo.use_kl_loss and algo.use_kl_in_reward, not both")
        check(self.policy_loss in POLICY_LOSSES,
              f"algo.policy_loss must be one of {', '.join(POLICY_LOSSES)}, got {self.policy_loss!r}")
        check(0 < self.gspo_clip_ratio_low < 1 and 0 < self.gspo_clip_ratio_high,
              "algo.gspo_clip_ratio_low must be in (0, 1) and algo.gspo_clip_ratio_high > 0")
        check(self.cispo_clip_ratio_low is None or 0 < self.cispo_clip_ratio_low < 1,
              "algo.cispo_clip_ratio_low must be in (0, 1) or null (no lower bound)")
        check(self.cispo_clip_ratio_high > 0, "algo.cispo_clip_ratio_high must be > 0")
        check(self.rollout_correction in ROLLOUT_CORRECTIONS,
              f"algo.rollout_correction must be one of {', '.join(ROLLOUT_CORRECTIONS)}, "
              f"got {self.rollout_correction!r}")
        check(self.rollout_correction_cap > 0, "algo.rollout_correction_cap must be > 0")
        lo = 0.0 if self.rollout_correction_low is None else self.rollout_correction_low
        hi = self.rollout_correction_high
        check(lo >= 0 and (hi is None or hi > lo),
              "algo.rollout_correction_low / _high must satisfy 0 <= low < high (or be null for the defaults)")
        check(self.max_gen_batches >= 1, f"algo.max_gen_batches must be >= 1, got {self.max_gen_batches}")
        check(self.gen_batches_per_round >= 1,
              f"algo.gen_batches_per_round must be >= 1, got {self.gen_batches_per_round}")
        # GSPO's policy loss is always seq-mean-token-mean (the paper's, verl's): the global mode applies to the KL /
        # entropy / LLDS terms; a mode that would mean something else for them than a user expects is refused
        check(self.policy_loss != "gspo" or self.loss_agg_mode in ("token-mean", "seq-mean-token-mean"),
              f"algo.policy_loss=gspo aggregates its loss seq-mean-token-mean (the GSPO paper's, verl's), whatever "
              f"algo.loss_agg_mode says; {self.loss_agg_mode} would apply to the KL / entropy / LLDS terms only: set "
              "algo.loss_agg_mode=token-mean (default) or seq-mean-token-mean")
        check(not (self.turn_credit.enabled and self.adv_estimator not in ("grpo", "rloo")),
              "algo.turn_credit groups turns across a group's trajectories, which needs a group estimator: set "
              "algo.adv_estimator=grpo (or rloo) or algo.turn_credit.weight=0")
        check(self.overlong_buffer >= 0, f"algo.overlong_buffer must be >= 0 (0 = off), got {self.overlong_buffer}")
        check(self.overlong_penalty >= 0, f"algo.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        check(not self.filter_groups or self.adv_estimator in ("grpo", "rloo"),
              "algo.filter_groups drops groups of equal rewards, which needs a group estimator: set "
              "algo.adv_estimator=grpo (or rloo) or algo.filter_groups=false")

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator == "gae"


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Actor learning rate (Search-R1: 1e-6)."""
    critic_lr: float = 1e-5
    """Critic learning rate (Search-R1's PPO: 1e-5)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    clip_grad: float = 1.0
    """Gradient-norm clip."""
    warmup_steps_ratio: float = 0.0
    """Linear LR warmup over this share of the total steps (Search-R1's actor: 0.285 for PPO, 0 for GRPO)."""
    lr_decay: str = "constant"
    """After warmup: constant, linear or cosine (to min_lr_ratio * lr)."""
    min_lr_ratio: float = 0.0
    """Final LR of a decaying schedule, as a share of lr."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one training / log-prob micro-batch (padded tokens; sequences are length-sorted)."""
    critic_warmup: int = 0
    """The actor updates from step critic_warmup on (verl's rule): steps 1 .. critic_warmup-1 train only the critic."""

    def __post_init__(self):
        self.betas = tuple(float(b) for b in self.betas)
        check(self.lr > 0 and self.critic_lr > 0, "optim.lr and optim.critic_lr must be > 0")
        check(self.lr_decay in ("constant", "linear", "cosine"), "optim.lr_decay must be constant, linear or cosine")
        check(0 <= self.warmup_steps_ratio < 1, "optim.warmup_steps_ratio must be in [0, 1)")
        check(self.max_tokens_per_micro_batch >= 64, "optim.max_tokens_per_micro_batch must be >= 64")


@dataclass
class TrainerConfig:
    output_dir: str = "runs/default"
    """Where the resolved config, TensorBoard events, trajectories, checkpoints and the HF export go."""
    total_steps: int = 100
    """Training steps (one step = one batch of prompts)."""
    save_freq: int = 50
    """Checkpoint every k steps (0 = only at the end)."""
    keep_last: int = 2
    """Checkpoints kept."""
    test_freq: int = 25
    """Validate every k steps (0 = never during training)."""
    val_before_train: bool = True
    """Validate before the first step."""
    val_only: bool = False
    """Only validate (greedy EM per data_source), then exit."""
    resume: str = "auto"
    """auto (latest checkpoint in output_dir if any), disable, or a checkpoint step directory."""
    export_hf: bool = True
    """Write the final actor as a Hugging Face dir (<output_dir>/hf) through the converter."""
    seed: int = 1
    """Seed of data order, sampling and init."""
    stop_on_collapse: bool = False
    """Save a checkpoint and stop when the positive-advantage log-likelihood falls (algo/collapse.py)."""
    collapse_window: int = 20
    """Steps over which the positive-advantage log-likelihood fall is measured."""
    collapse_nats: float = 0.5
    """A fall of more than this many nats over collapse_window steps counts as a collapse."""

    def __post_init__(self):
        check(self.total_steps >= 0, "trainer.total_steps must be >= 0")
        check(self.save_freq >= 0 and self.test_freq >= 0, "trainer.save_freq / test_freq must be >= 0")
        check(self.keep_last >= 1, "trainer.keep_last must be >= 1")
        check(self.collapse_window >= 1, f"trainer.collapse_window must be >= 1, got {self.collapse_window}")
        check(self.collapse_nats > 0, f"trainer.collapse_nats must be > 0, got {self.collapse_nats}")
        check(self.resume in ("auto", "disable") or os.path.isdir(self.resume),
              f"trainer.resume must be auto, disable or an existing checkpoint dir, got {self.resume!r}")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard events to <output_dir>/tensorboard."""
    trajectories_per_step: int = 4
    """Sampled trajectories written to <output_dir>/trajectories.jsonl per step (0 = none)."""
    progress_bar: bool = True
    """Progress on rank 0: a tqdm bar on a terminal, a plain line every few steps in a log file (console.py)."""
    plot: bool = False
    """At the end, plot the run's curves as PNGs in output_dir (plots.py): RL reward / EM, SFT training_loss.png."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        # algo.rollout_correction=auto: asynchronous (disaggregated) runs train on batches one or more versions old,
        # so the engine's log-probs (behaviour) differ from the trainer's (proximal) by more than kernels: correct per
        # token, truncated at the cap (verl's default token TIS; AReaL always weights behaviour vs proximal). A
        # colocated step samples with the weights it trains, so no correction unless asked.
        if self.algo.rollout_correction == "auto":
            disagg = self.parallel.rollout_placement == "disaggregated"
            self.algo.rollout_correction = "token_tis" if disagg else "none"
        if self.algo.routing_replay:  # what a replay needs besides an MoE model (validate() reads config.json)
            check(self.rollout.engine == "vllm",
                  f"algo.routing_replay replays the experts the vllm engine records; "
                  f"rollout.engine={self.rollout.engine} records none: set rollout.engine=vllm or "
                  f"algo.routing_replay=false")
            check(not self.rollout.tree.enabled and not self.rollout.partial,
                  "algo.routing_replay does not cover tree rollouts or rollout.partial yet (a tree's shared prefixes "
                  "and a mid-trajectory weight load need their own stitching): set rollout.tree.trees=0 and "
                  "rollout.partial=false, or algo.routing_replay=false")
            check(self.model.recompute != "full",
                  "algo.routing_replay with model.recompute=full is not supported (the recompute in backward routes "
                  "again after later micro-batches set their ids): set model.recompute=selective or none")

    def trainer_world(self, world_size: int) -> int:
        """How many of `world_size` ranks train: all of them (colocated), or all but parallel.rollout_ranks."""
        p = self.parallel
        return world_size - p.rollout_ranks if p.rollout_placement == "disaggregated" else world_size

    def check_placement(self, world_size: int) -> None:
        """The disaggregated placement's rules (trainer/async_rl.py), each refusal naming what to change: nothing
        to check when colocated."""
        p, r, a, t = self.parallel, self.rollout, self.algo, self.trainer
        if p.rollout_placement != "disaggregated":
            return
        check(world_size > p.rollout_ranks,
              f"parallel.rollout_ranks={p.rollout_ranks} leaves no trainer rank in a world of {world_size}: launch "
              f"`torchrun --nproc_per_node {p.rollout_ranks + p.tp * p.pp}` or lower parallel.rollout_ranks")
        mp, trainers = p.tp * p.pp, world_size - p.rollout_ranks
        check(trainers % mp == 0,
              f"parallel.rollout_ranks={p.rollout_ranks} leaves {trainers} trainer ranks of {world_size}, not a "
              f"multiple of parallel.tp * parallel.pp = {mp}: launch `torchrun --nproc_per_node "
              f"{p.rollout_ranks + mp}` (the rollout ranks + a multiple of {mp}) or change parallel.rollout_ranks")
        check(r.engine_tp == 1, f"parallel.rollout_placement=disaggregated runs one engine per rollout rank for "
                                f"now: set rollout.engine_tp=1 (got {r.engine_tp}) and add rollout ranks instead")
        check(p.pp == 1, f"parallel.rollout_placement=disaggregated supports parallel.pp=1 only for now (got "
                         f"{p.pp}): raise parallel.tp, or use parallel.rollout_placement=colocated")
        check(not self.model.lora.enabled, "parallel.rollout_placement=disaggregated does not send LoRA weights yet: "
                                           "set model.lora.rank=0 or parallel.rollout_placement=colocated")
        check(not a.filter_groups, "algo.filter_groups (DAPO's dynamic sampling) needs the trainer to ask for more "
                                   "prompts mid-step, which the disaggregated placement does not do: set "
                                   "algo.filter_groups=false or parallel.rollout_placement=colocated")
        check(not t.val_only, "trainer.val_only runs no training: use parallel.rollout_placement=colocated")
        check(t.total_steps >= 1, "parallel.rollout_placement=disaggregated needs trainer.total_steps >= 1")

    def validate(self, world_size: Optional[int] = None, check_files: bool = True) -> None:
        """Cross-section rules and the files the run reads; cheap (no model is built)."""
        a, r, p, d = self.algo, self.rollout, self.parallel, self.data
        check(not r.partial or p.rollout_placement == "disaggregated",
              "rollout.partial=true loads new weights into rollout ranks mid-trajectory, which only the disaggregated "
              "placement has (colocated steps generate with one version): set parallel.rollout_placement="
              "disaggregated or rollout.partial=false")
        check(a.adv_estimator != "tree_grpo" or r.tree.enabled,
              "algo.adv_estimator=tree_grpo compares the leaves of trees: set rollout.tree.trees >= 1 (and rollout.n to "
              "trees * leaves per tree), or another estimator")
        check(not r.tree.enabled or p.rollout_placement == "colocated",
              "rollout.tree (tree rollouts) runs in the colocated placement only: the disaggregated rollout ranks "
              "stream chains; set parallel.rollout_placement=colocated or rollout.tree.trees=0")
        check(not r.tree.enabled or not a.filter_groups,
              "rollout.tree with algo.filter_groups is not supported: set algo.filter_groups=false")
        check(r.async_granularity == "share" or p.rollout_placement == "disaggregated",
              "rollout.async_granularity=group streams GRPO groups from rollout ranks of their own, which only the "
              "disaggregated placement has: set parallel.rollout_placement=disaggregated or "
              "rollout.async_granularity=share")
        check(not self.model.freeze.enabled,
              "model.freeze (freeze fine-tuning) is for SFT (python -m megatron_searchr1.sft); RL trains every weight "
              "or LoRA adapters (model.lora): set model.freeze.trainable_layers=null")
        # the engines' log-probs are those of the sampling distribution (temperature, then top-k / top-p); the
        # trainer's are at the temperature without truncation: they compare only with top-k / top-p off
        check(a.rollout_correction == "none" or (r.top_p == 1.0 and r.top_k in (-1, 0)),
              f"algo.rollout_correction={a.rollout_correction} compares the engine's log-probs with the trainer's, "
              f"which have no top-k / top-p truncation: set rollout.top_p=1.0 and rollout.top_k=-1 (got "
              f"{r.top_p}, {r.top_k}) or algo.rollout_correction=none")
        # LLDS penalises a fall below the rollout-time log-prob: the first update of a step starts at it, so with
        # one update per step (one epoch, one mini-batch) the penalty is always 0
        check(not a.llds.enabled or a.ppo_epochs > 1 or a.ppo_mini_batch_size < d.train_batch_size,
              "algo.llds acts from a step's second update on, and this config makes one (algo.ppo_epochs=1, "
              "algo.ppo_mini_batch_size = data.train_batch_size): lower algo.ppo_mini_batch_size or raise "
              "algo.ppo_epochs")
        if a.overlong_buffer:
            check(a.overlong_buffer <= r.max_response_length,
                  f"algo.overlong_buffer ({a.overlong_buffer}) must be <= rollout.max_response_length "
                  f"({r.max_response_length}): lower the buffer")
        if a.adv_estimator in ("grpo", "rloo", "tree_grpo"):
            check(r.n >= 2, f"algo.adv_estimator={a.adv_estimator} compares samples of one prompt: set rollout.n "
                            f">= 2 (got {r.n})")
        if world_size is not None:
            self.check_placement(world_size)
            world_size = self.trainer_world(world_size)
            dp = p.data_parallel_size(world_size)
            # a vLLM TP group must hold one DP rank's trajectories: its ranks lie inside one model-parallel group
            try:
                check_engine_layout(world_size, p.tp, p.pp, r.engine_tp)
            except LayoutError as e:
                raise ConfigError(str(e)) from None
            check(d.train_batch_size % dp == 0,
                  f"data.train_batch_size={d.train_batch_size} must be a multiple of the DP size {dp}")
            check(a.ppo_mini_batch_size % dp == 0,
                  f"algo.ppo_mini_batch_size={a.ppo_mini_batch_size} must be a multiple of the DP size {dp}")
        # every trajectory (prompt + response) must fit one micro-batch, or plan_micro_batches raises on one
        # rank hours into a run while the others wait in the next collective
        check(d.max_prompt_length + r.max_response_length <= self.optim.max_tokens_per_micro_batch,
              f"data.max_prompt_length ({d.max_prompt_length}) + rollout.max_response_length "
              f"({r.max_response_length}) = {d.max_prompt_length + r.max_response_length} tokens must fit in "
              f"optim.max_tokens_per_micro_batch ({self.optim.max_tokens_per_micro_batch}): raise the budget or "
              "lower the lengths")
        if self.retrieval.launch:  # the other ranks wait for the server's URL in a collective bounded by this
            check(self.retrieval.launch_timeout < p.timeout_minutes * 60,
                  f"retrieval.launch_timeout ({self.retrieval.launch_timeout:g}s) must be shorter than "
                  f"parallel.timeout_minutes ({p.timeout_minutes} min), which the other ranks wait for the "
                  "server's URL under: raise parallel.timeout_minutes")
        check(d.train_batch_size % a.ppo_mini_batch_size == 0,
              f"data.train_batch_size={d.train_batch_size} must be a multiple of algo.ppo_mini_batch_size="
              f"{a.ppo_mini_batch_size}")
        if not check_files:
            return
        # this machine's part (the planner checks a GPU recipe anywhere, with check_files=False)
        no_cuda = p.rollout_placement == "disaggregated" and p.bridge_backend == "nccl" and no_cuda_reason()
        check(not no_cuda, f"parallel.bridge_backend=nccl needs CUDA, but {no_cuda}: set parallel.bridge_backend=auto "
                           "or gloo")
        check(bool(self.model.path), "model.path is required (a Hugging Face model dir with config.json)")
        hf_json = os.path.join(self.model.path, "config.json")
        check(os.path.isfile(hf_json), f"model.path={self.model.path!r} has no config.json: pass a Hugging Face "
                                       "model dir (tools/make_tiny_model.py writes one)")
        with open(hf_json) as f:
            hf = json.load(f)
        # the converter's check: a *.safetensors cut short (or a shard missing) is one line here, not a
        # SafetensorError on every rank after the process groups, the model and the engine are up
        from megatron_searchr1.weight_files import WeightFileError, check_weight_files
        try:
            check_weight_files(self.model.path, "model.path", require=False)
        except WeightFileError as e:
            raise ConfigError(f"model.path={self.model.path}: {e}") from None
        heads, layers = hf.get("num_attention_heads", 1), hf.get("num_hidden_layers", 1)
        check(heads % p.tp == 0, f"parallel.tp={p.tp} does not divide the model's num_attention_heads={heads}: "
                                 "choose a TP that divides it")
        check(layers % p.pp == 0, f"parallel.pp={p.pp} does not divide the model's num_hidden_layers={layers}")
        # LLDS compares per-token likelihoods across updates; on MoE models the router may send a token to other
        # experts in training than at rollout, which the paper handles by replaying the engine's routing
        experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
        check(not (a.llds.enabled and experts and not a.routing_replay),
              f"algo.llds on a MoE model ({experts} experts) needs rollout routing replay: set "
              "algo.routing_replay=true (or algo.llds.coef=0 and answer_coef=null)")
        check(not a.routing_replay or bool(experts),
              f"algo.routing_replay replays the experts of a mixture-of-experts model; {self.model.path} is dense "
              "(its config.json names no num_experts): set algo.routing_replay=false")
        if self.model.megatron_ckpt:
            check(os.path.isdir(self.model.megatron_ckpt),
                  f"model.megatron_ckpt={self.model.megatron_ckpt!r} does not exist")
        if not self.trainer.val_only:
            check(bool(d.train_files), "data.train_files is empty: pass data.train_files=[path/train.parquet]")
        # evaluation (trainer.val_only) reads only the validation files: the recipe's train files need not exist
        for path in ([] if self.trainer.val_only else list(d.train_files)) + list(d.val_files):
            check(os.path.isfile(path), f"data file {path!r} does not exist")
        if self.trainer.val_only or self.trainer.test_freq or self.trainer.val_before_train:
            check(bool(d.val_files) or not (self.trainer.val_only),
                  "trainer.val_only=true needs data.val_files")

