# python tools/make_synthetic_world.py --out-dir data/synthetic --seed 0 --oracle bm25
"""The synthetic world's command line: the world (synthetic.py), an index over its corpus, and gold trajectories
written by the oracle (oracle.py) through that index, so SFT data shows exactly what the RL rollout will see.

    python tools/make_synthetic_world.py --out-dir data/synthetic --seed 0 --oracle bm25
    (world only, < 1 s: drop --oracle; other retrievers: --oracle dense, --oracle-index-dir DIR,
     --oracle-url http://127.0.0.1:8000/retrieve; sizes: --n-people 180 --n-train 2000 ..., see --help)

Writes corpus.jsonl, {train,validation,test}.parquet, world.json, and with an oracle index_<kind>/ and sft/
({split}.jsonl + dataset_info.json).
"""
from __future__ import annotations

import dataclasses
import os
import time

from megatron_searchr1.cli import ArgumentParser, UsageError, console, run_main
from megatron_searchr1.data.prompts import TEMPLATES
from megatron_searchr1.data.synthetic import SPLITS, WorldConfig, generate, heldout_titles, write_world


def build_arg_parser() -> ArgumentParser:
    p = ArgumentParser(description="Generate the synthetic world: corpus, questions, gold trajectories.")
    p.add_argument("--out-dir", required=True, help="writes corpus.jsonl, {train,validation,test}.parquet, "
                                                    "world.json (and sft/, index_<kind>/ with --oracle)")
    for f in dataclasses.fields(WorldConfig):
        if f.name == "hop_fractions":
            p.add_argument("--hop-fractions", default="0.4,0.35,0.25", help="shares of 1,2,3-hop questions")
        elif f.name == "template":
            p.add_argument("--template", default=f.default, choices=TEMPLATES, help="prompt template")
        else:
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--oracle", choices=("bm25", "dense", "hybrid"),
                   help="build this index over the corpus in <out-dir>/index_<kind> and write gold trajectories "
                        "with it (in-process; serve that index for RL so rollouts see the same results)")
    g.add_argument("--oracle-index-dir", help="write gold trajectories with an existing index directory")
    g.add_argument("--oracle-url", help="write gold trajectories through a running retrieval server "
                                        "(e.g. http://127.0.0.1:8000/retrieve)")
    p.add_argument("--oracle-splits", default="train", help="comma list of splits to write trajectories for")
    p.add_argument("--topk", type=int, default=3, help="passages per search (as in the RL rollout)")
    p.add_argument("--keep-misses", action="store_true",
                   help="also write trajectories whose retrieval missed a gold passage (flagged gold_retrieved)")
    p.add_argument("--keep-heldout", action="store_true",
                   help="also write train trajectories whose searches returned a held-out passage (flagged "
                        "shows_heldout); by default they are dropped so SFT never shows a validation/test fact")
    p.add_argument("--protocol", choices=("search_r1", "tool_calls"), default="search_r1",
                   help="the protocol of the parquet prompts and of the gold trajectories: Search-R1's tags, or the "
                        "model's own tool calls (LLaMA-Factory tool data; rollout.protocol=tool_calls)")
    p.add_argument("--stop-early", type=float, default=0.0,
                   help="a lazy demonstrator: the probability, at each point where a multi-hop gold chain needs "
                        "another search, that its trajectory answers a guess instead (leaves RL the decision to "
                        "search again; see data/oracle.py)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        hop_fractions = tuple(float(x) for x in args.hop_fractions.split(","))
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(WorldConfig) if f.name != "hop_fractions"}
        if args.protocol == "tool_calls":
            fields["template"] = "tool_calls"  # the tool_calls protocol's prompt
        cfg = WorldConfig(**fields, hop_fractions=hop_fractions)
    except ValueError as e:
        raise UsageError(f"{e} (--hop-fractions and the size flags)") from None
    splits = [s for s in args.oracle_splits.split(",") if s]
    bad = set(splits) - set(SPLITS)
    if bad:
        raise UsageError(f"--oracle-splits: unknown split(s) {sorted(bad)}; choose from {SPLITS}")
    if args.oracle_index_dir and not os.path.isfile(os.path.join(args.oracle_index_dir, "index_meta.json")):
        raise UsageError(f"--oracle-index-dir {args.oracle_index_dir!r} has no index_meta.json")
    if args.topk < 1:
        raise UsageError(f"--topk must be >= 1, got {args.topk}")
    if not 0.0 <= args.stop_early <= 1.0:
        raise UsageError(f"--stop-early must be a probability in [0, 1], got {args.stop_early}")

    t0 = time.time()
    try:
        world, rows = generate(cfg)
    except ValueError as e:  # too many questions asked of too small a world: the message names the knobs
        raise UsageError(str(e)) from None
    paths = write_world(world, rows, args.out_dir)
    print(f"{len(world.entities)} entities, {len(world.passages)} passages -> {paths['corpus']}")
    for split in SPLITS:
        hops = [r["extra_info"]["hops"] for r in rows[split]]
        mix = ", ".join(f"{h}-hop {hops.count(h)}" for h in (1, 2, 3))
        print(f"{split}: {len(hops)} questions ({mix}) -> {paths[split]}")
    print(f"world generated in {time.time() - t0:.1f}s")

    if not (args.oracle or args.oracle_index_dir or args.oracle_url):
        return 0
    from megatron_searchr1.data import oracle

    if args.oracle_url:
        from megatron_searchr1.search.client import RetrievalClient

        search = oracle.client_searcher(RetrievalClient(args.oracle_url, topk=args.topk,
                                                        doc_ids=args.protocol == "tool_calls"))
    else:
        from megatron_searchr1.search.retrievers import index_corpus, load_retriever

        if args.oracle:
            index_dir = os.path.join(args.out_dir, f"index_{args.oracle}")
            retriever = index_corpus(paths["corpus"], index_dir, kind=args.oracle)
            print(f"built {args.oracle} index -> {index_dir}")
        else:
            retriever = load_retriever(args.oracle_index_dir)
        search = oracle.retriever_searcher(retriever, topk=args.topk, doc_ids=args.protocol == "tool_calls")
    gold_text = {p["id"]: p["text"] for p in world.passages}
    # only train trajectories are checked for held-out passages: those passages are validation/test's own gold
    held = heldout_titles(world)
    trajs = {s: oracle.gold_trajectories(rows[s], search, gold_text, heldout_titles=held if s == "train" else None,
                                         stop_early=args.stop_early, seed=cfg.seed, protocol=args.protocol)
             for s in splits}
    sft_dir = os.path.join(args.out_dir, "sft")
    counts = oracle.write_sft(trajs, sft_dir, keep_misses=args.keep_misses, keep_heldout=args.keep_heldout)
    for s in splits:
        skipped = oracle.skipped_counts(trajs[s])
        print(f"sft {s}: {counts[s]} of {len(trajs[s])} trajectories written ({skipped['missed_gold']} missed a "
              f"gold passage{'' if args.keep_misses else ', skipped'}; {skipped['shows_heldout']} were shown a "
              f"held-out passage{'' if args.keep_heldout else ', skipped'}) -> {sft_dir}/{s}.jsonl")
        if args.stop_early:
            multi = [t for t in trajs[s] if t["hops"] > 1]
            lazy = sum(t["searches"] < t["hops"] for t in multi)
            print(f"sft {s}: the lazy demonstrator (--stop-early {args.stop_early}) gave up early on {lazy} of "
                  f"{len(multi)} multi-hop trajectories")
    print(f"done in {time.time() - t0:.1f}s")
    return 0


cli = console(main)  # the console script (setup.py)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
