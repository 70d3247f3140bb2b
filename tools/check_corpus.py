# python tools/check_corpus.py data/synthetic/train.parquet --retriever http://127.0.0.1:8000 --topk 3 10
"""Before training: how many questions of an RL parquet the corpus can answer (gold answers in the retrieved
passages, per data_source); see megatron_searchr1/data/corpus_check.py for the definitions."""
from megatron_searchr1.cli import run_main
from megatron_searchr1.data.corpus_check import main

if __name__ == "__main__":
    raise SystemExit(run_main(main))
