"""The CPU demo's report: EM per split and hop count before and after RL and without search, sample trajectories and
where everything is, from what the stages wrote (report.json, and the table megatron_searchr1/demo.py prints).

    report = summarize("runs/cpu_demo", timings, total_s, seed=3, base="examples/demo_base")
    print(render(report))
"""
from __future__ import annotations

import json
import os
from typing import Optional


def base_summary(base: str) -> str:
    """What base.json says of a base, for the model stage's line."""
    path = os.path.join(base, "base.json")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        info = json.load(f)
    return (f" ({info['steps']} warm-up steps on worlds {info['sft_worlds'][0]}-{info['sft_worlds'][-1]}; "
            f"reproduced {info['val_exact']:.0%} of world {info['val_world']}'s single-hop trajectories)")


def _cells(table: dict) -> dict:
    return {k: {"n": v["n"], "em": v["em"], "searches": v["searches"]} for k, v in table.items()}


def summarize(work: str, timings: dict, total: float, seed: Optional[int] = None,
              base: Optional[str] = None, protocol: str = "search_r1") -> dict:
    """Before/after/no-search EM per split and hop count, sample trajectories, paths; written to report.json."""
    grpo = _read_reports(os.path.join(work, "grpo", "val_report.jsonl"))
    no_search = _read_reports(os.path.join(work, "no_search", "val_report.jsonl"))
    samples = _read_reports(os.path.join(work, "grpo", "val_trajectories.jsonl"))
    last_step = grpo[-1]["step"]
    pictures = [os.path.join(work, d, f) for d, f in (("sft", "training_loss.png"), ("grpo", "training_reward.png"),
                                                       ("grpo", "validation_em.png"))]
    report = {
        "seed": seed, "base": base, "protocol": protocol, "sft_steps": sft_result(os.path.join(work, "sft")),
        "pictures": [p for p in pictures if os.path.isfile(p)],
        "no_search": _cells(no_search[-1]["table"]), "before_rl": _cells(grpo[0]["table"]),
        "after_rl": _cells(grpo[-1]["table"]), "rl_steps": last_step,
        "em_by_rl_step": [[r["step"], r["table"]["all"]["em"]] for r in grpo],
        "samples": [s for s in samples if s["step"] == last_step][:3],
        "tensorboard": [os.path.join(work, d, "tensorboard") for d in ("sft", "grpo")],
        "hf_model": os.path.join(work, "grpo", "hf"), "timings_s": timings, "total_s": total, "work_dir": work,
    }
    with open(os.path.join(work, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def sft_result(sft_dir: str) -> dict:
    """The warm-up's last step, and its last validation (a stopped-early run: the one that stopped it)."""
    from megatron_searchr1.plots import read_metrics

    m = read_metrics(sft_dir)
    out = {"steps": m["sft/loss"][-1][0] if m.get("sft/loss") else None}
    if m.get("val/exact"):
        out["val_exact"] = m["val/exact"][-1][1]
    return out


def render(report: dict) -> str:
    rows = [k for k in report["after_rl"] if k.startswith("split:")] + sorted(
        k for k in report["after_rl"] if k.startswith("synthetic"))
    sft = report.get("sft_steps", {})
    start = report.get("base")
    start = "" if not start else (" from scratch" if start == "scratch" else f" from {os.path.basename(start)}")
    read = f" (held-out single-hop trajectories reproduced: {sft['val_exact']:.3f})" if "val_exact" in sft else ""
    warm = f"{sft['steps']} warm-up steps{start}{read}, " if sft.get("steps") else ""
    proto = "" if report.get("protocol", "search_r1") == "search_r1" else f" ({report['protocol']} protocol)"
    lines = ["", f"CPU demo, world seed {report.get('seed')}{proto}: exact match (EM) and mean searches, after {warm}"
                 f"before and after {report['rl_steps']} GRPO steps",
             f"{'questions':<22}{'n':>5}{'no search':>11}{'SFT':>8}{'SFT+RL':>8}{'searches':>10}"]
    for k in rows:
        b, s, r = (report[x].get(k, {}) for x in ("no_search", "before_rl", "after_rl"))
        lines.append(f"{k.replace('split:', ''):<22}{r.get('n', 0):>5}{b.get('em', 0):>11.3f}{s.get('em', 0):>8.3f}"
                     f"{r.get('em', 0):>8.3f}{s.get('searches', 0):>5.2f}->{r.get('searches', 0):.2f}")
    if len(report["em_by_rl_step"]) > 2:
        lines.append("EM (all questions) by GRPO step: "
                     + ", ".join(f"{step}: {em:.3f}" for step, em in report["em_by_rl_step"]))
    for i, sample in enumerate(report["samples"], 1):
        lines += ["", f"--- validation trajectory {i}: {sample['question']} (gold: {', '.join(sample['target'])}; "
                      f"reward {sample['score']:.0f}, {sample['finish']})"]
        lines += [f"  [{kind}] {text.strip()}" for kind, text in sample["turns"]]
    lines += ["", f"TensorBoard: tensorboard --logdir {report['work_dir']}   ({', '.join(report['tensorboard'])})",
              "Pictures: " + (", ".join(report.get("pictures", [])) or "none"),
              f"Exported model (transformers / vLLM): {report['hf_model']}",
              "Stage times: " + ", ".join(f"{k} {v:.0f}s" for k, v in report["timings_s"].items())
              + f"; total {report['total_s'] / 60:.1f} min"]
    return "\n".join(lines)


def _read_reports(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
