r"""FlashRAG QA files -> training/validation parquet in Search-R1's schema.

The command line over data/qa.py, which says what goes in and what comes out (the row schema). Every input is read
before anything is written, so a mistake in the test files leaves no half-written output.

Examples:
    python tools/prepare_qa_data.py --train nq=raw/nq/train.jsonl hotpotqa=raw/hotpotqa/train.jsonl \
        --test nq=raw/nq/test.jsonl bamboogle=raw/bamboogle/test.jsonl --out-dir data/nq_hotpotqa
    python tools/prepare_qa_data.py --flashrag-dir raw --train-sources nq,hotpotqa \
        --test-sources nq,triviaqa,popqa,hotpotqa,2wikimultihopqa,musique,bamboogle --out-dir data/nq_hotpotqa
"""
from __future__ import annotations

import os

from megatron_searchr1.cli import ArgumentParser, UsageError, console, run_main
from megatron_searchr1.data.prompts import TEMPLATES
from megatron_searchr1.data.rl_data import known_sources, unscored_sources
from megatron_searchr1.data.qa import (
    QADataError, SourceFile, build_split, find_flashrag_file, parse_source_spec, write_rows,
)


def main(argv: list[str] | None = None) -> int:
    examples = __doc__[__doc__.index("Examples:"):]
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=examples)
    p.add_argument("--train", nargs="*", default=[], metavar="NAME=PATH", help="train files, merged in order")
    p.add_argument("--test", nargs="*", default=[], metavar="NAME=PATH", help="test/validation files, merged")
    p.add_argument("--flashrag-dir", help="FlashRAG layout root: <dir>/<name>/{train,dev,test}.jsonl")
    p.add_argument("--train-sources", default="", help="comma list of names under --flashrag-dir for train")
    p.add_argument("--test-sources", default="", help="comma list of names under --flashrag-dir for test "
                                                      "(their test file, or dev when there is no test file)")
    p.add_argument("--template", default="base", choices=TEMPLATES,
                   help="base: Search-R1's raw prompt; chat: system+user messages for the tokenizer's chat template")
    p.add_argument("--out-dir", required=True, help="writes train.parquet and test.parquet here")
    args = p.parse_args(argv)

    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise UsageError(f"--out-dir {args.out_dir!r} is a file: give a directory")
    if (args.train_sources or args.test_sources) and not args.flashrag_dir:
        raise UsageError("--train-sources/--test-sources need --flashrag-dir")
    if args.flashrag_dir and not os.path.isdir(args.flashrag_dir):
        raise UsageError(f"--flashrag-dir {args.flashrag_dir!r} is not a directory")
    try:
        train = [parse_source_spec(s) for s in args.train]
        test = [parse_source_spec(s) for s in args.test]
        for n in filter(None, args.train_sources.split(",")):
            train.append(SourceFile(n, find_flashrag_file(args.flashrag_dir, n, ("train",))))
        for n in filter(None, args.test_sources.split(",")):
            test.append(SourceFile(n, find_flashrag_file(args.flashrag_dir, n, ("test", "dev"))))
        for flag, sources in (("--train", train), ("--test", test)):
            for src in sources:
                if unscored_sources([src.name]):  # it becomes data_source; training would fail at its first reward
                    raise UsageError(f"{flag}: source name {src.name!r} (for {src.path}) has no reward; known: "
                                     f"{known_sources()}: write NAME=PATH with one of them (the name becomes each "
                                     f"row's data_source and picks its reward)")
                if not os.path.isfile(src.path):
                    raise UsageError(f"{flag}: QA file {src.path!r} (source {src.name!r}) does not exist")
        if not train and not test:
            raise UsageError("nothing to do: give --train/--test files or --flashrag-dir with "
                             "--train-sources/--test-sources")
        splits = {split: build_split(sources, split, args.template)
                  for split, sources in (("train", train), ("test", test)) if sources}
    except (QADataError, FileNotFoundError) as e:  # the messages name the file and what to fix
        raise UsageError(str(e)) from None
    # Written only once every input has been read: a mistake in the test files leaves no half-written output.
    for split, rows in splits.items():
        sources = train if split == "train" else test
        path = os.path.join(args.out_dir, f"{split}.parquet")
        write_rows(rows, path)
        counts = ", ".join(f"{s.name}={sum(r['data_source'] == s.name for r in rows)}" for s in sources)
        print(f"wrote {path}: {len(rows)} rows ({counts})")
    return 0


cli = console(main)  # the console script (setup.py)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
