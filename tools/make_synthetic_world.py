# python tools/make_synthetic_world.py --out-dir data/synthetic --seed 0 --oracle bm25
# (world only, < 1 s: drop --oracle; other retrievers: --oracle dense, --oracle-index-dir DIR,
#  --oracle-url http://127.0.0.1:8000/retrieve; sizes: --n-people 180 --n-train 2000 ..., see --help)
"""Generate the synthetic world for the CPU demo and tests (see megatron_searchr1/data/make_world.py)."""
from megatron_searchr1.cli import run_main
from megatron_searchr1.data.make_world import main

if __name__ == "__main__":
    raise SystemExit(run_main(main))
