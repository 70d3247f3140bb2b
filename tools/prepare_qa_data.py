# python tools/prepare_qa_data.py --train nq=raw/nq/train.jsonl hotpotqa=raw/hotpotqa/train.jsonl \
#     --test nq=raw/nq/test.jsonl hotpotqa=raw/hotpotqa/dev.jsonl --out-dir data/nq_hotpotqa [--template base|chat]
# or, for a FlashRAG download laid out as <dir>/<name>/{train,dev,test}.jsonl:
# python tools/prepare_qa_data.py --flashrag-dir raw --train-sources nq,hotpotqa \
#     --test-sources nq,triviaqa,popqa,hotpotqa,2wikimultihopqa,musique,bamboogle --out-dir data/nq_hotpotqa
"""Convert FlashRAG QA files into Search-R1-schema parquet (see megatron_searchr1/data/qa.py)."""
from megatron_searchr1.cli import run_main
from megatron_searchr1.data.qa_cli import main

if __name__ == "__main__":
    raise SystemExit(run_main(main))
