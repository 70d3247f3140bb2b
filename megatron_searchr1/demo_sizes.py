"""The CPU demo's sizes and seeds: how big each run is, which worlds it builds, and the shipped base it starts from.

    SIZES["ci"], SIZES["full"]            # the 2-minute run CI executes; the README's measured run
    world_seeds(3, 2)                     # ([100003, 100004], 200003): a seed's warm-up worlds and validation world
    check_base("examples/demo_base")      # a directory `--make-base` wrote, or a UsageError

megatron_searchr1/demo.py runs the stages; examples/cpu_demo_sizes.md holds the measurements behind each size.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron_searchr1.cli import UsageError


@dataclass(frozen=True)
class Size:
    world: tuple[str, ...]
    """make_synthetic_world.py arguments, but the seed (`seed`, the demo's --seed)."""
    seed: int
    """The RL world's seed (the demo's --seed overrides it); the SFT worlds' and the validation world's seeds
    follow from it (`world_seeds`)."""
    sft_steps: int
    """The warm-up's optimizer steps from the shipped base (`BASE_DIR`): the cap when `sft_stop_at` is set."""
    sft_batch: int
    """SFT examples per step."""
    grpo_steps: int
    """GRPO steps after the warm-up."""
    grpo_batch: int
    """Prompts per GRPO step (each sampled `n` times)."""
    n: int
    """Samples per prompt (GRPO group size)."""
    val_samples: int
    """Questions per split for each evaluation."""
    grpo_test_freq: int = 0
    """Validate every this many GRPO steps as well (0: before and after only)."""
    sft_worlds: int = 1
    """How many worlds (same sizes as the RL world, other seeds) write the SFT data from the base (from scratch:
    `scratch_sft_worlds`). Several worlds: more distinct names, so the warm-up learns to copy and read names
    rather than memorise a few thousand trajectories over many epochs. None is the RL world: RL on questions the
    warm-up had memorised re-samples memorised answers, while held-out questions need reading
    (examples/cpu_demo_sizes.md)."""
    sft_val: int = 0
    """Single-hop gold trajectories of one more world (`world_seeds`) that the warm-up validates on (0: none): its
    exact share (trainer/sft.py `validate`) says whether the model reads the answer from the retrieved passages."""
    sft_val_freq: int = 100
    """Validate the warm-up every this many steps."""
    sft_stop_at: Optional[float] = None
    """Stop the warm-up once its validation exact share reaches this (trainer.stop_at_val_exact), `sft_steps`
    being the cap: when the answer-reading skill appears varies from seed to seed, and RL needs it."""
    sft_loss_on_passages: bool = True
    """Put the warm-up's loss on every token, the retrieved passages and the prompt included
    (data.train_on_prompt), not only on what the model writes. A model trained from scratch learns to copy a name
    from the passages' own repetitions (a title, then the same name in the text) long before it learns to copy
    one into a query or an answer, so the answer-reading skill appears sooner (examples/cpu_demo.md). GRPO's loss
    stays on the model's own tokens, as Search-R1's does."""
    sft_lr: float = 3e-4
    """The warm-up's learning rate from the base (constant after a short warm-up: examples/sft_tiny_cpu.yaml). The
    base already reads; at the from-scratch rate (1e-3) its first hundred steps on new worlds undo part of that."""
    scratch_sft_steps: int = 3000
    """The warm-up's cap from a random model (`--base scratch`, and `--make-base`, which builds the base this way)."""
    scratch_sft_lr: float = 1e-3
    """The warm-up's learning rate from a random model."""
    scratch_sft_worlds: int = 4
    """SFT worlds from a random model: reading from scratch takes ~3,000 steps of 16, over ~22,000 examples."""
    scratch_val_freq: int = 100
    """Validate a warm-up from a random model every this many steps."""
    model_layers: int = 4
    """Decoder layers of the tiny model."""
    eta_s: tuple[tuple[str, float], ...] = ()
    """Expected seconds per stage on a free 2-core machine (measured: examples/cpu_demo.md), printed as each stage
    starts; SFT's is per step, GRPO's per step including its validations."""
    grpo_lr: float = 3e-5
    """GRPO's learning rate. From the base the multi-hop gain comes within 8-16 steps at 1e-4, 5e-5 or 3e-5 alike,
    but single-hop EM slipped at one seed of three at the faster rates (seed 2: -0.029 at 1e-4, -0.013 at 5e-5) and
    held at every seed at 3e-5 (examples/cpu_demo.md)."""
    sft_stop_early: float = 0.0
    """The SFT worlds' lazy demonstrator (make_world --stop-early): at each point where a multi-hop chain needs
    another search, its trajectory answers a guess instead with this probability. Above 0.5 the warm-up's greedy
    policy gives up after the first search on multi-hop questions, and RL has to learn from the reward that
    searching again pays; on perfect chains little is left for RL to learn (examples/cpu_demo_sizes.md)."""


SIZES = {
    # every stage runs for real at toy length (CI).
    # GRPO at 1e-4: at 5e-5 its 8-12 steps end before the policy learns to search again (measured: 0.32 -> 0.34).
    "ci": Size(world=(), seed=0, sft_steps=40, sft_batch=16, grpo_steps=12, grpo_batch=8, n=8, val_samples=50,
               sft_worlds=1, grpo_test_freq=6, grpo_lr=1e-4, sft_stop_early=0.6, sft_val=16, sft_val_freq=20,
               scratch_sft_steps=40, scratch_sft_worlds=1, scratch_val_freq=20,
               eta_s=(("world", 5), ("model", 10), ("sft", 0.8), ("no_search", 20), ("grpo", 7))),
    # The README's run (examples/cpu_demo.md): a diverse world so the warm-up learns to copy unseen names into
    # queries; as short as the effect allows (the runs that chose these lengths: examples/cpu_demo_sizes.md).
    "full": Size(world=("--n-people", "8000", "--n-companies", "2500", "--n-cities", "1500",
                        "--n-products", "2500", "--n-universities", "800", "--n-distractors", "3000",
                        "--n-train", "6000", "--n-validation", "300", "--n-test", "300"),
                 seed=3, sft_steps=400, sft_batch=16, grpo_steps=24, grpo_batch=8, n=8, val_samples=300,
                 sft_worlds=2, grpo_test_freq=8, sft_stop_early=0.6, sft_val=64, sft_val_freq=50,
                 sft_stop_at=0.6, eta_s=(("world", 25), ("model", 15), ("sft", 0.5), ("no_search", 25),
                                         ("grpo", 7.0))),
}
MODEL_ARGS = dict(hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2, tie_embeddings=True,
                  vocab_size=2000)
SFT_SEED_OFFSET = 100_000
"""The SFT worlds' seeds are seed + 100000 + i and the SFT validation world's seed + 200000: for any --seed below
100000 neither is ever an RL world, so the warm-up never sees the questions RL trains and is evaluated on."""
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
BASE_DIR = os.path.join(EXAMPLES, "demo_base")
"""The shipped base: a tiny Qwen2 and its tokenizer that already read search results (`--make-base` built it; its
base.json says how). The demo's warm-up starts from it, as Search-R1 starts from a pretrained model: reading
retrieved passages takes a random model ~3,000 warm-up steps (~30 min on 2 cores) and appears at a step that
varies from draw to draw, while what RL teaches, searching again on multi-hop questions, needs a model that reads."""
BASE_SEED = 300_000
"""The base's SFT worlds are BASE_SEED + i and its validation world BASE_SEED + 1000: above every seed a --seed run
uses (RL < 100000, SFT < 200004, validation < 300000), so no run's RL questions were in the base's training."""
BASE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
PROTOCOLS = ("search_r1", "tool_calls")
"""--protocol: Search-R1's tags (the default), or tool calls in the tokenizer's chat template."""
TOOL_TEMPLATE = os.path.join(EXAMPLES, "demo_base_tool_calls.jinja")
"""The chat template with tool calling the demo gives its tokenizer under --protocol tool_calls: Qwen2.5's layout
(the tools' JSON schemas in the system turn between <tools> tags, calls as <tool_call> JSON </tool_call>, results as
<tool_response> blocks in a user turn) with a two-line instruction instead of Qwen's paragraph, for a 2,008-token
vocabulary that spells JSON a character or two per token."""


def protocol_overrides(protocol: str) -> list[str]:
    """The RL stages' config overrides for `protocol` (none for Search-R1's, whose settings the YAML holds). One
    tool (`search`: the synthetic world's passages are short, `open` has nothing to add); the lengths fit the tool
    format's longer spelling (measured on the demo's worlds, examples/cpu_demo.md): the prompt with the schema
    ~390 tokens, a call ~60 (Search-R1's ~12), a 3-hop trajectory ~1,100."""
    if protocol == "search_r1":
        return []
    return ["rollout.protocol=tool_calls", "rollout.tool_parser=hermes", "rollout.tools=[search]",
            "rollout.max_tokens_per_turn=120", "rollout.max_response_length=1536", "data.max_prompt_length=512"]


def sft_protocol_overrides(protocol: str) -> list[str]:
    """The warm-up's config overrides for `protocol`: room for the tool format's longer trajectories."""
    return [] if protocol == "search_r1" else ["data.max_length=2048"]


def world_seeds(seed: int, n_sft: int) -> tuple[list[int], int]:
    """The SFT worlds' seeds and the SFT validation world's, for the RL world's `seed`.

    >>> world_seeds(3, 2)
    ([100003, 100004], 200003)
    """
    return [seed + SFT_SEED_OFFSET + i for i in range(n_sft)], seed + 2 * SFT_SEED_OFFSET


def base_seeds(n_sft: int) -> tuple[list[int], int]:
    """The base's SFT worlds' seeds and its validation world's (`--make-base`).

    >>> base_seeds(2)
    ([300000, 300001], 301000)
    """
    return [BASE_SEED + i for i in range(n_sft)], BASE_SEED + 1000


def check_base(path: str) -> None:
    """Raise UsageError unless `path` holds a base model (what --make-base writes)."""
    missing = [f for f in BASE_FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise UsageError(f"--base {path}: no {', '.join(missing)} there; pass a directory --make-base wrote, or "
                         "'scratch' for a random model")
