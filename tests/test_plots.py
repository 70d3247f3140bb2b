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


def test_validation_em_draws_all_last_and_thicker(tmp_path, monkeypatch):
    """With one validation source, "all" equals it: drawn first and as thin, it would be hidden under that curve
    (the demo's validation_em.png showed no "all"). It is drawn last (on top) and thicker."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))  # keep the figures to look at their lines
    # "all" logged first, as the trainer does: the order of the metrics must not decide what is on top
    write_metrics(tmp_path, [{"step": s, "val/all/em": s / 20, "val/split:validation/em": s / 20,
                              "val/synthetic_1hop/em": s / 10} for s in (0, 5, 10)])
    plot_rl_curves(str(tmp_path))
    (em,) = [f for f in figures if f.axes[0].get_title() == "validation (greedy)"]
    lines = em.axes[0].get_lines()
    assert lines[-1].get_label() == "all"
    assert all(lines[-1].get_linewidth() > other.get_linewidth() for other in lines[:-1])
    assert all(lines[-1].get_zorder() > other.get_zorder() for other in lines[:-1])
