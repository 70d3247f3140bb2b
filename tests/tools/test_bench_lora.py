"""tools/benchmarks/bench_lora.py: LoRA's gradient + optimizer bytes next to full fine-tuning's, measured in one run
(tiny settings), and the Qwen3-4B formula lines."""
import os
import re
import subprocess
import sys

import pytest

from tests.dist_utils import REPO


@pytest.mark.slow
def test_lora_holds_gradients_and_adam_state_only_for_the_adapters():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "benchmarks" / "bench_lora.py"), "--hidden", "32",
                           "--layers", "2", "--vocab", "100", "--seq-len", "16", "--batch", "2", "--steps", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m[0]: [int(x.replace(",", "")) for x in m[1:]] for m in re.findall(
        r"^  (full|lora): trainable ([\d,]+)  gradients ([\d,]+) B  optimizer ([\d,]+) B", proc.stdout, re.M)}
    for trainable, grad, opt in rows.values():  # fp32: a 4-byte gradient and two 4-byte Adam moments each
        assert grad == 4 * trainable and opt == 8 * trainable
    # rank 8 on all 7 projections of 2 layers (hidden 32, q/kv 8 heads x 8 / 2 x 8, intermediate 64)
    assert rows["lora"][0] == 2 * 8 * ((32 + 32) * 2 + (32 + 16) * 2 + (32 + 64) * 3)
    ratio = float(re.search(r"gradients\+optimizer bytes ([\d.]+)", proc.stdout).group(1))
    assert ratio == pytest.approx(rows["lora"][0] / rows["full"][0], abs=1e-4) and ratio < 0.5
    assert re.search(r"step time [\d.]+", proc.stdout)
    assert "full: 4,022,468,096 trainable" in proc.stdout and "16,515,072 trainable (0.41%)" in proc.stdout
