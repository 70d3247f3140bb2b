"""tools/benchmarks/bench_padding.py: prints ours next to Search-R1's layout and exits by the target."""
import importlib.util

from tests.dist_utils import REPO

_spec = importlib.util.spec_from_file_location("bench_padding", REPO / "tools" / "benchmarks" / "bench_padding.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
fixed_layout_share, main = bench.fixed_layout_share, bench.main


def test_prints_both_layouts_and_meets_the_target(capsys):
    assert main(["--sequences", "128", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "Search-R1" in out and "meets the target of 5%" in out


def test_exit_1_when_the_target_is_missed(capsys):
    assert main(["--sequences", "64", "--seeds", "1", "--target", "0.0001"]) == 1
    assert "MISSES" in capsys.readouterr().out


def test_fixed_layout_share():
    assert fixed_layout_share([(1, 1), (2, 2)], 2, 8) == 1 - 6 / 16   # rows padded to 8 tokens
    assert fixed_layout_share([(1, 1), (2, 2)], 2, None) == 1 - 6 / 8  # padded to the longest row (4)
