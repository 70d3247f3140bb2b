"""SFT validation and early stop (trainer/sft.py): held-out loss and exact share every trainer.val_freq steps, the
exact share equal to what a Hugging Face forward pass of the exported model says, a run that stops once it reaches
trainer.stop_at_val_exact (and stays stopped when resumed), data.train_on_prompt, and LLaMA-Factory's
eval_dataset / eval_steps / train_on_prompt keys."""
from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest

from megatron_searchr1.config import ConfigError, SFTConfig, load_config
from megatron_searchr1.config.llamafactory import translate
from tests.dist_utils import REPO

EXAMPLE = os.path.join(REPO, "examples", "qwen3_lora_sft.yaml")
N_TRAIN = 12
COLOURS = ["red", "green", "blue", "black", "white", "grey", "pink", "brown", "gold", "silver", "orange", "purple"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny Qwen2 and a memorisable alpaca dataset: 12 training records, the first 6 of them again as the
    validation dataset (so the exact share can reach 1 within a few dozen steps)."""
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("sftval")
    make_tiny_model(TinyModelConfig(output_dir=str(root / "tiny"), hidden_size=64, num_layers=2, vocab_size=400))
    data = root / "data"
    data.mkdir()
    records = [{"instruction": f"Name the colour number {i}.", "input": "", "output": COLOURS[i]}
               for i in range(N_TRAIN)]
    (data / "train.json").write_text(json.dumps(records))
    (data / "val.json").write_text(json.dumps(records[:6]))
    (data / "dataset_info.json").write_text(json.dumps({"numbers": {"file_name": "train.json"},
                                                        "numbers_val": {"file_name": "val.json"}}))
    return root


def lf_yaml(root, name: str, **keys) -> str:
    """LLaMA-Factory's keys for a full fine-tune of the tiny model on `numbers`, validated on `numbers_val`."""
    base = {"model_name_or_path": str(root / "tiny"), "stage": "sft", "do_train": True, "finetuning_type": "full",
            "dataset": "numbers", "eval_dataset": "numbers_val", "eval_steps": 5, "dataset_dir": str(root / "data"),
            "cutoff_len": 64, "output_dir": str(root / name), "per_device_train_batch_size": 12,
            "learning_rate": 1e-2, "lr_scheduler_type": "constant", "max_steps": 200, "report_to": "none",
            "overwrite_output_dir": True, **keys}
    path = root / f"{name}.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in base.items()))
    return str(path)


def metrics(out_dir) -> dict:
    from megatron_searchr1.plots import read_metrics

    return read_metrics(str(out_dir))


def hf_exact_share(model_dir: str, data_dir: str, dataset: str) -> float:
    """The exact share by hand: the exported model's token probabilities (transformers) on each example, the
    share whose every loss-mask token (after the first) has probability > 1/2."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_searchr1.data.sft_data import load_sft_dataset

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    exact = []
    for ex in load_sft_dataset(data_dir, [dataset], tok, 64):
        ids = torch.tensor([ex.input_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        tok_lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
        on = torch.tensor(ex.loss_mask[1:]) > 0
        exact.append(bool((tok_lp[on] > math.log(0.5)).all()))
    return sum(exact) / len(exact)


@pytest.mark.slow
def test_validation_every_k_steps_matches_the_exported_model(root):
    from tests.rl_fixtures import run_module

    proc = run_module("megatron_searchr1.sft", [lf_yaml(root, "plain", max_steps=12)])
    out = root / "plain"
    m = metrics(out)
    assert [s for s, _ in m["val/exact"]] == [5, 10, 12]  # every eval_steps, and at the end
    assert [s for s, _ in m["val/loss"]] == [5, 10, 12]
    assert m["val/loss"][-1][1] < m["val/loss"][0][1]  # the held-out loss follows the training
    assert "validation at step 12: loss" in proc.stdout
    final = m["val/exact"][-1][1]
    assert final == pytest.approx(hf_exact_share(str(out / "hf"), str(root / "data"), "numbers_val"))


@pytest.mark.slow
def test_stops_once_the_exact_share_is_reached_and_stays_stopped(root):
    """Memorising 12 records reaches an exact share of 0.5 well before the 200-step cap; the run stops at
    that validation, says so, exports that model, and a resume (overwrite_output_dir false) trains no further."""
    from tests.rl_fixtures import run_module

    proc = run_module("megatron_searchr1.sft", [lf_yaml(root, "stop"), "trainer.stop_at_val_exact=0.5"])
    out = root / "stop"
    m = metrics(out)
    stop_step, exact = m["val/exact"][-1]
    assert exact >= 0.5 and all(v < 0.5 for _, v in m["val/exact"][:-1])
    assert stop_step < 200 and stop_step % 5 == 0 and m["sft/loss"][-1][0] == stop_step
    assert f"SFT stopped early at step {stop_step}" in proc.stdout
    import torch

    state = torch.load(out / "checkpoints" / f"step_{stop_step:06d}" / "trainer_state.pt", weights_only=False)
    assert state["extra"]["stopped_early"]["step"] == stop_step, state["extra"]
    assert hf_exact_share(str(out / "hf"), str(root / "data"), "numbers_val") == pytest.approx(exact)

    again = run_module("megatron_searchr1.sft", [lf_yaml(root, "stop", overwrite_output_dir=False),
                                                  "trainer.stop_at_val_exact=0.5"])
    assert metrics(out)["sft/loss"][-1][0] == stop_step  # no step after the stop
    assert f"SFT stopped early at step {stop_step}" in again.stdout

    # a raised target resumes the stopped run and trains on from the stop (the same checkpoint, not a fresh start)
    more = run_module("megatron_searchr1.sft", [lf_yaml(root, "stop", overwrite_output_dir=False),
                                                 "trainer.stop_at_val_exact=1.0"])
    assert f"resuming a run stopped early at step {stop_step}" in more.stdout
    m = metrics(out)
    assert m["sft/loss"][-1][0] > stop_step and min(s for s, _ in m["sft/loss"] if s > stop_step) == stop_step + 1


def test_train_on_prompt_puts_the_loss_on_every_token():
    from megatron_searchr1.trainer.sft import SFTTrainer

    ex = SimpleNamespace(input_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1])
    on = SimpleNamespace(cfg=SimpleNamespace(data=SimpleNamespace(train_on_prompt=True)))
    off = SimpleNamespace(cfg=SimpleNamespace(data=SimpleNamespace(train_on_prompt=False)))
    assert SFTTrainer._mask(on, ex) == [1, 1, 1, 1]
    assert SFTTrainer._mask(off, ex) == [0, 0, 1, 1]


def test_llamafactory_keys_map_to_validation_and_train_on_prompt(root):
    cfg = load_config(lf_yaml(root, "keys", train_on_prompt=True), [], cls=SFTConfig,
                      translate=lambda raw: translate(raw, 1, lambda s: None))
    assert (cfg.data.val_datasets, cfg.trainer.val_freq, cfg.data.train_on_prompt) == (["numbers_val"], 5, True)
    cfg = load_config(lf_yaml(root, "keys2", eval_dataset=None, eval_steps=None), [], cls=SFTConfig,
                      translate=lambda raw: translate(raw, 1, lambda s: None))
    assert (cfg.data.val_datasets, cfg.trainer.val_freq, cfg.data.train_on_prompt) == ([], 0, False)


def test_stop_needs_validation_data_and_a_share(root):
    with pytest.raises(ConfigError, match="stop_at_val_exact needs data.val_datasets"):
        cfg = load_config(lf_yaml(root, "bad", eval_dataset=None), ["trainer.stop_at_val_exact=0.5"],
                          cls=SFTConfig, translate=lambda raw: translate(raw, 1, lambda s: None))
        cfg.validate(world_size=1)
    with pytest.raises(ConfigError, match=r"stop_at_val_exact must be in \(0, 1\]"):
        load_config(lf_yaml(root, "bad2"), ["trainer.stop_at_val_exact=1.5"], cls=SFTConfig,
                    translate=lambda raw: translate(raw, 1, lambda s: None))
