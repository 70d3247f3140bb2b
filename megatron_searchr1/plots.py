"""Curves of a finished run as PNGs (matplotlib, headless), from the `metrics.jsonl` its RunLogger wrote.

    plot_sft_loss("runs/sft")      # runs/sft/training_loss.png: raw and smoothed loss by step (LLaMA-Factory's plot)
    plot_rl_curves("runs/grpo")    # runs/grpo/training_reward.png (reward by step), validation_em.png (EM per source)

TensorBoard stays the live view; these are the pictures a run leaves behind. A resumed run appends to metrics.jsonl
and may log a step twice: the last value of a step wins.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional


def read_metrics(output_dir: str) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value)] sorted by step, the last record of a step winning."""
    path = os.path.join(output_dir, "metrics.jsonl")
    by_key: dict[str, dict[int, float]] = {}
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            step = int(rec.pop("step"))
            for k, v in rec.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    by_key.setdefault(k, {})[step] = float(v)
    return {k: sorted(d.items()) for k, d in by_key.items()}


def smooth(values: list[float]) -> list[float]:
    """Exponential moving average whose weight grows with the curve's length (short curves barely smoothed).

    >>> smooth([1.0, 1.0, 1.0])
    [1.0, 1.0, 1.0]
    """
    if not values:
        return []
    weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(values))) - 0.5)
    out, last = [], values[0]
    for v in values:
        last = last * weight + (1 - weight) * v
        out.append(last)
    return out


def plot_curves(path: str, curves: dict[str, list[tuple[int, float]]], title: str, ylabel: str,
                smoothed: bool = False, xlabel: str = "step", ylim: Optional[tuple[float, float]] = None,
                raw: tuple[str, ...] = (), bold: tuple[str, ...] = ()) -> Optional[str]:
    """One figure, one line per curve (with `smoothed`: each raw curve faint, its smoothed version on top, but the
    curves named in `raw`, drawn as they are); the curves named in `bold` are drawn last and thicker, so one that
    equals another (validation EM over "all" sources when there is one source) is not hidden under it. Returns the
    path, or None when there is nothing to draw."""
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for name in sorted(curves, key=lambda k: k in bold):  # stable: the bold ones last, on top
        points = curves[name]
        steps, values = [s for s, _ in points], [v for _, v in points]
        width = {"linewidth": 3.0, "zorder": 3} if name in bold else {}
        if smoothed and name not in raw:
            line, = ax.plot(steps, values, alpha=0.4, label=f"{name} (raw)")
            ax.plot(steps, smooth(values), color=line.get_color(), label=f"{name} (smoothed)", **width)
        else:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=name, **width)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sft_loss(output_dir: str, key: str = "sft/loss") -> Optional[str]:
    """<output_dir>/training_loss.png from the run's logged loss."""
    metrics = read_metrics(output_dir)
    curves = {"loss": metrics.get(key, []), "held-out loss (data.val_datasets)": metrics.get("val/loss", [])}
    return plot_curves(os.path.join(output_dir, "training_loss.png"), curves, "SFT loss",
                       "loss (mean NLL per trained token, nats)", smoothed=True, xlabel="SFT step",
                       raw=("held-out loss (data.val_datasets)",))


def plot_rl_curves(output_dir: str) -> list[str]:
    """<output_dir>/training_reward.png (the rollouts' mean reward and EM by step, raw and smoothed) and
    validation_em.png (greedy validation EM, `val/<source>/em`, one line per data source); the paths written."""
    metrics = read_metrics(output_dir)
    written = [plot_curves(os.path.join(output_dir, "training_reward.png"),
                           {"reward": metrics.get("reward/mean", []), "EM": metrics.get("reward/em", [])},
                           "training rollouts", "mean over the step's trajectories", smoothed=True,
                           xlabel="RL step"),
               plot_curves(os.path.join(output_dir, "validation_em.png"),
                           {k.removeprefix("val/").removesuffix("/em"): v for k, v in metrics.items()
                            if k.startswith("val/") and k.endswith("/em")}, "validation (greedy)",
                           "exact match (share of questions)", xlabel="RL step", ylim=(0.0, 1.0), bold=("all",))]
    return [p for p in written if p]
