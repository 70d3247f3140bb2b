# python tools/benchmarks/bench_stop_check.py                    (a 150k byte-level BPE, trained here)
# python tools/benchmarks/bench_stop_check.py --vocab 30000 --batch 512
"""The cost of vLLM's stop check on KV-session requests, for two choices of the stop candidates.

A session request cannot carry stop strings, so the vllm engine stops it on every token that could complete one
(vllm_sessions.stop_candidates). vLLM checks `last_token in sampling_params.stop_token_ids` after every generated
token of every running request, on the engine thread, and keeps that field as a list: a linear scan of every
candidate for each token that is not one (nearly all of them). Compared: candidates = tokens holding '>' or U+FFFD,
as a list ("before"), and tokens holding '>' only (the stops end in ASCII), as a frozenset ("after": what
stop_candidates returns).

The tokenizer is a byte-level BPE trained here on a synthetic corpus (Latin words, 8000 CJK characters with Zipf
frequencies, HTML-like punctuation runs), the same tokenizer family and size as Qwen2.5's (151k); the counts of
a real tokenizer differ, the per-check cost grows with them. Prints the candidate counts, the time per check and
per decode step of `--batch` running requests, and the ratio before / after.
"""
from __future__ import annotations

import random
import time

from megatron_searchr1.cli import ArgumentParser, at_least, run_main

STOPS = ("</search>", "</answer>")
"""Search-R1's stop strings (megatron_searchr1.data.prompts.STOP_STRINGS)."""


def train_byte_level_bpe(vocab_size: int, seed: int = 0, lines: int = 4000):
    """A byte-level BPE (GPT-2/Qwen pre-tokenizer and decoder) of `vocab_size` ids trained on a synthetic corpus
    (module doc)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    latin = [chr(c) for c in range(97, 123)] * 6 + [chr(c) for c in range(65, 91)] * 2 + list("0123456789") \
        + [chr(c) for c in range(0xE0, 0x100)] + [chr(c) for c in range(0x430, 0x450)]
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 8000)]
    punct = list("<>/=-\"'(){}[];:!?.,*#&|") + [">"] * 6
    tags = ["</answer>", "<search>", "</search>", "<information>", "</information>", "<think>", "\n"]
    words = ["".join(rng.choice(latin) for _ in range(rng.randint(2, 10))) for _ in range(150_000)]

    def zipf(n: int, a: float) -> int:
        return min(int(rng.paretovariate(a)) - 1, n - 1)

    def corpus():
        for _ in range(lines):
            parts = []
            for _ in range(400):
                parts.append(words[zipf(len(words), 0.7)] if rng.random() < 0.5 else rng.choice(words))
                if rng.random() < 0.15:
                    parts.append(rng.choice(tags))
                if rng.random() < 0.1:
                    parts.append("".join(rng.choice(punct) for _ in range(rng.randint(1, 4))))
                if rng.random() < 0.3:
                    parts.append("".join(cjk[zipf(len(cjk), 0.6)] for _ in range(rng.randint(1, 4))))
            yield " ".join(parts)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


def per_check_ns(stop_ids, stream: list[int], repeats: int = 3) -> float:
    """Best-of-`repeats` nanoseconds of one `token in stop_ids` (vLLM's check_stop) over `stream`."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        hits = 0
        for token in stream:
            if token in stop_ids:
                hits += 1
        best = min(best, time.perf_counter() - t)
    return best / len(stream) * 1e9


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=at_least(1000), default=150_000, help="BPE vocabulary size")
    p.add_argument("--batch", type=at_least(1), default=256, help="running requests per decode step")
    p.add_argument("--checks", type=at_least(1000), default=20_000, help="token ids checked per measurement")
    args = p.parse_args(argv)

    from megatron_searchr1.rollout.engines.vllm_sessions import stop_candidates

    t = time.perf_counter()
    tok = train_byte_level_bpe(args.vocab)
    vocab = tok.get_vocab_size()
    texts = tok.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    print(f"byte-level BPE: {vocab} ids, trained and decoded in {time.perf_counter() - t:.1f} s")
    lasts = {s[-1] for s in STOPS}
    before = sorted(i for i, x in enumerate(texts) if "\ufffd" in x or any(c in x for c in lasts))
    after = stop_candidates(texts, STOPS)
    print(f"stop candidates: before {len(before)} (holding '>' or U+FFFD), after {len(after)} (holding '>')")

    rng = random.Random(1)
    stream = [rng.randrange(vocab) for _ in range(args.checks)]
    rows = [("before: list, '>' or U+FFFD", per_check_ns(before, stream)),
            ("list, '>' only", per_check_ns(sorted(after), stream)),
            ("after: frozenset, '>' only", per_check_ns(after, stream))]
    for name, ns in rows:
        print(f"  {name:<30} {ns:10.1f} ns per check  {ns * args.batch / 1e3:10.1f} us per decode step "
              f"of {args.batch} requests")
    print(f"ratio before / after: {rows[0][1] / rows[2][1]:.0f}x")


if __name__ == "__main__":
    run_main(main)
