"""Writes verl_reference.json: inputs and verl's outputs for its GSPO / CISPO / vanilla PPO losses, its
seq-mean-token-sum-norm aggregation and its rollout-correction IS weights, read by tests/algo/test_policy_losses.py
and tests/algo/test_rollout_correction.py.

    python tests/algo/data/make_verl_reference.py /work/.mirror/volcengine+verl/repo

Reads verl's two source files out of a verl git directory (`git show HEAD:...`), stubs the imports they need
for configuration objects (the functions used here only read clip ranges from them), and runs them with the
local torch. This script never imports megatron_searchr1, so the file holds verl's numbers, not ours.
"""
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

OUT = Path(__file__).with_name("verl_reference.json")


def _stub_modules():
    def masked_sum(values, mask, axis=None):
        valid = torch.where(mask.bool(), values, torch.zeros_like(values))
        return valid.sum() if axis is None else valid.sum(dim=axis)

    def masked_mean(values, mask, axis=None):  # verl's: sum / (count + 1e-8)
        count = mask.sum() if axis is None else mask.sum(dim=axis)
        return masked_sum(values, mask, axis) / (count + 1e-8)

    class ActorConfig:
        def __init__(self, clip_ratio, clip_ratio_low=None, clip_ratio_high=None):
            self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = clip_ratio, clip_ratio_low, clip_ratio_high
            self.global_batch_info = {}

        def get(self, key, default=None):
            return getattr(self, key, default)

    class Unused:  # stands for config classes the functions used here only test against
        pass

    mods = {
        "omegaconf": {"DictConfig": dict},
        "verl": {}, "verl.utils": {"as_torch_index": None, "group_mean_std": None},
        "verl.utils.torch_functional": {"masked_sum": masked_sum, "masked_mean": masked_mean},
        "verl.utils.import_utils": {"deprecated": lambda *a, **k: (lambda f: f)},
        "verl.trainer": {}, "verl.trainer.config": {"AlgoConfig": Unused},
        "verl.trainer.config.algorithm": {"RolloutCorrectionConfig": Unused},
        "verl.workers": {}, "verl.workers.config": {"ActorConfig": ActorConfig},
        "verl.workers.config.actor": {"PolicyLossConfig": Unused},
        "verl.protocol": {"DataProto": Unused},
    }
    for name, attrs in mods.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    sys.modules["verl.utils"].torch_functional = sys.modules["verl.utils.torch_functional"]
    return ActorConfig


def _load(git_dir: str, path: str, name: str, tmp: Path):
    src = subprocess.run(["git", "--git-dir", git_dir, "show", f"HEAD:{path}"], check=True, capture_output=True,
                         text=True).stdout
    file = tmp / f"{name}.py"
    file.write_text(src)
    sys.path.insert(0, str(tmp))
    return __import__(name)


def main(git_dir: str) -> None:
    ActorConfig = _stub_modules()
    commit = subprocess.run(["git", "--git-dir", git_dir, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        core = _load(git_dir, "verl/trainer/ppo/core_algos.py", "verl_core_algos", Path(tmp))
        rc = _load(git_dir, "verl/trainer/ppo/rollout_corr_helper.py", "verl_rollout_corr", Path(tmp))
        g = torch.Generator().manual_seed(0)
        B, T = 4, 6
        old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2  # (B, T) log-probs in (-2, 0]
        new = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 1.0  # (B, T) moved by +-0.5
        adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)[:, None].expand(B, T).contiguous()
        mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 1, 0]],
                            dtype=torch.float64)
        engine = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.4  # (B, T)
        cases = {}
        cfg = ActorConfig(0.2, 0.2, 0.28)
        loss, m = core.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", cfg)
        cases["ppo"] = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                        "loss": loss.item(), "pg_clipfrac": m["actor/pg_clipfrac"]}
        # GSPO with wide ranges so that some sequences are clipped and some are not
        cfg = ActorConfig(0.05, 0.02, 0.03)
        loss, m = core.compute_policy_loss_gspo(old, new, adv, mask, "seq-mean-token-mean", cfg)
        cases["gspo"] = {"clip_ratio_low": 0.02, "clip_ratio_high": 0.03, "loss": loss.item(),
                         "pg_clipfrac": m["actor/pg_clipfrac"]}
        cfg = ActorConfig(0.2, 0.2, 0.1)
        loss, m = core.compute_policy_loss_cispo(old, new, adv, mask, "token-mean", cfg)
        cases["cispo"] = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.1, "loss": loss.item(),
                          "pg_clipfrac": m["actor/pg_clipfrac"]}
        lp = new.clone().requires_grad_(True)
        core.compute_policy_loss_cispo(old, lp, adv, mask, "token-mean", cfg)[0].backward()
        cases["cispo"]["grad"] = lp.grad.tolist()
        lp = new.clone().requires_grad_(True)
        core.compute_policy_loss_gspo(old, lp, adv, mask, "seq-mean-token-mean", ActorConfig(0.05, 0.02, 0.03))[
            0].backward()
        cases["gspo"]["grad"] = lp.grad.tolist()
        loss_mat = new * adv  # (B, T) any matrix
        cases["seq_mean_token_sum_norm"] = {
            "loss_scale_factor": 8.0,
            "verl_sum": core.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=8.0).item()}
        for level in ("token", "sequence"):
            w, _ = rc.compute_rollout_correction_weights(old - engine, mask, rollout_is=level, rollout_is_threshold=2.0)
            cases[f"is_{level}"] = {"cap": 2.0, "weights": w.tolist()}
        cases["k3_kl"] = rc.compute_offpolicy_metrics(old, engine, mask)["k3_kl"]
    data = {"verl_commit": commit, "old_log_prob": old.tolist(), "log_prob": new.tolist(), "advantages": adv.tolist(),
            "response_mask": mask.tolist(), "engine_log_prob": engine.tolist(), "cases": cases}
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("error: give the verl git directory, e.g. /work/.mirror/volcengine+verl/repo")
    main(sys.argv[1])
