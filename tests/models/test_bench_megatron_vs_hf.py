"""tools/benchmarks/bench_megatron_vs_hf.py at toy size: it loads HF weights through the families mapping, asserts
the logits equal HF's (exit status 1 when they do not), and prints its side-by-side ratios."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_searchr1.cli import UsageError
from megatron_searchr1.models.families import Qwen2Family, stack_gate_up
from tests.dist_utils import REPO
from tests.models.test_gpt import megatron_tp1  # noqa: F401  (fixture)

TINY = ["--threads", "1", "--batch", "1", "--seq", "16", "--hidden", "64", "--ffn", "128", "--layers", "2",
        "--heads", "4", "--kv-heads", "2", "--vocab", "300", "--warmup", "0", "--iters", "1"]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_megatron_vs_hf", REPO / "tools" / "benchmarks" / "bench_megatron_vs_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class UpGateSwapped(Qwen2Family):
    def hf_to_megatron(self, name, hf_tensors):
        if "linear_fc1" in name:
            gate, up = (hf_tensors[s] for s in self.hf_sources(name))
            return stack_gate_up(up, gate)
        return super().hf_to_megatron(name, hf_tensors)


def test_bench_checks_logits_and_prints_ratios(megatron_tp1, capsys):
    bench = _bench()
    assert bench.main(TINY) == 0
    out = capsys.readouterr().out
    assert "ratio megatron_ours / hf_sdpa" in out and "ratio megatron_original / hf_sdpa" in out
    assert "device cpu, local spec" in out  # every model on one device, both Megatron models on the local spec
    diffs = [float(line.rsplit("=", 1)[1]) for line in out.splitlines() if line.startswith("max |logits(")]
    assert len(diffs) == 2 and max(diffs) <= bench.TOL

    torch.manual_seed(0)
    assert bench.main(TINY + ["--no-original"], mapping_cls=UpGateSwapped) == 1  # a wrong mapping fails loudly
    captured = capsys.readouterr()
    assert "megatron_ours logits differ from HF's" in captured.err and "ratio" not in captured.out


def test_bench_device_choice_and_te_flag(capsys):
    """Every model goes to one device (auto: the GPU when torch sees one); --te needs a GPU."""
    bench = _bench()
    assert bench.resolve_device("cpu") == "cpu"
    assert bench.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="--te needs --device cuda"):
            bench.main(TINY + ["--device", "cpu", "--te"])
        with pytest.raises(UsageError, match="--device cuda but torch sees no GPU"):
            bench.resolve_device("cuda")
