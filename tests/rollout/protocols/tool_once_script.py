"""Under torchrun (gloo), the ranks of one engine (rollout.engine_tp = world) run the same tool round through the
trainer's RolloutWorker searcher, as the rollout loop does on every rank of an engine:

    torchrun --nproc_per_node 2 tests/rollout/protocols/tool_once_script.py CALLS_DIR

A Python tool of this script appends each call it gets to CALLS_DIR/rank{RANK}; the search client counts its
queries. Each rank prints `RESULT {"rank", "texts", "searched"}`: the observations it got and the queries its client
sent."""
import json
import os
import sys
from types import SimpleNamespace


def route(city, mode):
    """The tool: it leaves a trace of every call on the rank that ran it (a side effect, as a paid API has)."""
    rank = os.environ["RANK"]
    with open(os.path.join(os.environ["CALLS_DIR"], f"rank{rank}"), "a") as f:
        f.write(f"{city}\n")
    return f"{city} by {mode}, planned on rank {rank}"


def main():
    import torch.distributed as dist

    from megatron_searchr1.config import load_config
    from megatron_searchr1.rollout.protocols.parsers import ToolCall
    from megatron_searchr1.rollout.protocols.tools import ToolBox, tool_specs
    from megatron_searchr1.trainer.roles import RolloutWorker

    os.environ["CALLS_DIR"] = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(None, [f"parallel.tp={world}", f"rollout.engine_tp={world}", "rollout.protocol=tool_calls"])
    searched = []

    def search(queries):
        searched.extend(queries)
        return [f"Doc 1(id: 1, Title: \"X\") {q} (searched on rank {rank})\n" for q in queries]

    worker = RolloutWorker(cfg, None, None, SimpleNamespace(search=search, base_url="http://127.0.0.1:1"), (),
                           rank=rank, world=world)
    box = ToolBox(tool_specs(["search", {
        "name": "route", "endpoint": "python:tests.rollout.protocols.tool_once_script:route",
        "parameters": {"type": "object", "required": ["city", "mode"], "properties": {
            "city": {"type": "string"}, "mode": {"type": "string", "enum": ["walk", "train"]}}}}]))
    texts = []
    for turn in ([ToolCall("route", {"city": "Oslo", "mode": "walk"}), ToolCall("search", {"query": "acme"}),
                  ToolCall("route", {"city": "Rome", "mode": "train"})],
                 [ToolCall("route", {"city": "Pisa", "mode": "walk"})]):
        texts.append([o.text for o in box.run(turn, worker.searcher)])
    print("RESULT " + json.dumps({"rank": rank, "texts": texts, "searched": searched}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
