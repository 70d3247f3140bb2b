"""Tree rollouts (rollout/tree.py) in the tool_calls protocol: forks start at turn boundaries, i.e. right after a tool
delta, and every leaf is generated ids plus the template's deltas (Qwen2.5's real template), like a chain's."""
import random

from megatron_searchr1.rollout.engine import Generation
from megatron_searchr1.rollout.loop import LoopSettings, Trajectory
from megatron_searchr1.rollout.protocols import ProtocolSpec, build_protocol
from megatron_searchr1.rollout.protocols.tool_calls import tool_calls_messages
from megatron_searchr1.rollout.tree import TreeSettings, grow_trees
from tests.rollout.protocols.test_tool_calls import DOCS, PAGES, TOOLS, base_tok, call, with_template  # noqa: F401


class ToolEngine:
    """Each turn is drawn from (its context, the call's seed): a search, an open, or an answer (which closes the turn
    with <|im_end|>); calls stop at </tool_call> as a real engine's stop string leaves them. Records every context and
    the ids it generated from it."""

    def __init__(self, tok):
        self.tok = tok
        self.log: dict[tuple, list[list[int]]] = {}

    def generate(self, prompts, params, sessions=None):
        outs = []
        for i, p in enumerate(prompts):
            rng = random.Random(hash((tuple(p), params.seed, i)))
            roll = rng.random()
            if roll < 0.4:
                text, stop = call("search", query="who founded acme?"), "</tool_call>"
            elif roll < 0.7:
                text, stop = call("open", doc_id="7"), "</tool_call>"
            else:
                text, stop = f"<answer> a{rng.randint(0, 2)} </answer><|im_end|>", None
            ids = self.tok.encode(text, add_special_tokens=False)
            if stop is None:
                stop = ids[-1]
            self.log.setdefault(tuple(p), []).append(ids)
            outs.append(Generation(token_ids=ids, logprobs=[-rng.random() for _ in ids], finish_reason="stop",
                                   stop_reason=stop))
        return outs


def test_tool_calls_trees_fork_after_deltas_and_every_leaf_is_generated_ids_plus_deltas(base_tok):  # noqa: F811
    tok = with_template(base_tok, "qwen2_5")
    spec = ProtocolSpec("tool_calls", tools=TOOLS)
    proto = build_protocol(spec, tok)
    prompt = proto.prompt_ids(tool_calls_messages("Who founded Acme?"))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    settings = LoopSettings(max_turns=3, max_tokens_per_turn=200, max_response_length=3000, seed=5,
                            stop_token_ids=(im_end,), protocol_spec=spec)
    engine = ToolEngine(tok)
    roots = [Trajectory(prompt_ids=list(prompt), uid="q", sample=k) for k in range(2)]
    trees, _ = grow_trees(engine, tok, lambda qs: [DOCS[q] for q in qs], roots, settings,
                          TreeSettings(rounds=1, samples=3))
    assert [len(tr) for tr in trees] == [4, 4]
    leaves = [t for tr in trees for t in tr]
    assert sum(t.n_tool_calls for t in leaves) >= 4
    assert "answer" in {t.finish_reason for t in leaves} <= {"answer", "max_turns"}
    delta = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n")
    results = {"search": DOCS["who founded acme?"].strip(), "open": PAGES["7"]}
    for leaf in leaves:
        assert leaf.prompt_ids == prompt
        # walk the leaf: a mask-1 run is what the engine generated from exactly the context before it; a mask-0 run is
        # the template's tool message for that call's result
        at, ids, mask = 0, leaf.response_ids, leaf.loss_mask
        while at < len(ids):
            end = at
            while end < len(ids) and mask[end] == mask[at]:
                end += 1
            if mask[at]:
                assert ids[at:end] in engine.log[tuple(prompt + ids[:at])]
                text = tok.decode(ids[at:end])
            else:
                name = "search" if '"search"' in text else "open"
                assert tok.decode(ids[at:end]) == delta.format(results[name])
            at = end
