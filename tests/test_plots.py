"""plots.py: the PNG curves a run leaves behind (SFT's training_loss.png, RL's reward / EM), drawn headless from the
run's metrics.jsonl; a resumed run's repeated steps keep their last value."""
import json

import numpy as np
from PIL import Image

from megatron_searchr1.plots import plot_rl_curves, plot_sft_loss, read_metrics, smooth


def write_metrics(path, records):
    with open(path / "metrics.jsonl", "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def is_real_plot(png) -> bool:
    """A drawn figure: big enough, not one flat colour, some dark pixels (lines, text) on the white canvas."""
    img = np.asarray(Image.open(png).convert("L"), dtype=np.float32)
    return png.stat().st_size > 10_000 and img.shape[0] >= 300 and img.std() > 5 and (img < 128).mean() > 0.005


def test_sft_loss_plot_and_last_value_of_a_repeated_step_wins(tmp_path):
    write_metrics(tmp_path, [{"step": s, "sft/loss": 3.0 / s, "sft/lr": 1e-4} for s in range(1, 41)])
    write_metrics(tmp_path, [{"step": 40, "sft/loss": 9.0}])  # a resumed run logged step 40 again
    curve = read_metrics(str(tmp_path))["sft/loss"]
    assert [s for s, _ in curve] == list(range(1, 41)) and curve[-1] == (40, 9.0)
    png = plot_sft_loss(str(tmp_path))
    assert png == str(tmp_path / "training_loss.png") and is_real_plot(tmp_path / "training_loss.png")


def test_rl_curves_plot_reward_and_validation_em(tmp_path):
    write_metrics(tmp_path, [{"step": s, "reward/mean": s / 10, "reward/em": s / 20} for s in range(1, 11)])
    write_metrics(tmp_path, [{"step": s, "val/nq/em": s / 30, "val/all/em": s / 40, "val/all/f1": 0.5}
                             for s in (0, 5, 10)])
    written = plot_rl_curves(str(tmp_path))
    assert sorted(written) == [str(tmp_path / "training_reward.png"), str(tmp_path / "validation_em.png")]
    assert all(is_real_plot(tmp_path / p) for p in ("training_reward.png", "validation_em.png"))


def test_nothing_logged_draws_nothing_and_smoothing_lags_a_jump(tmp_path):
    assert plot_sft_loss(str(tmp_path)) is None and plot_rl_curves(str(tmp_path)) == []
    s = smooth([0.0] * 50 + [1.0] * 50)
    assert s[49] == 0.0 and 0.0 < s[50] < 1.0 and s[-1] > 0.9
