"""megatron/schedule.py and the roles' forwards (trainer/roles.py) end to end on a tiny Qwen2 (vocab 300: padded
to 384 at TP=1, 512 at TP=2), real torchrun runs.

One launch per layout (schedule_script.py computes everything), results compared here:
  * log-probs and entropy (temperature 0.7) at TP=1 equal HF's log_softmax; TP=2, PP=2 and DP=2 equal TP=1;
    critic values too (PP=2: results broadcast from the last stage, rank 0 is the first stage);
  * the gradient of a token-mean loss is the same from 1 micro-batch and from 3, and DP=2 (each rank half the
    sequences, unequal shares) equals DP=1 on the union; TP=2's gathered gradient equals TP=1's;
  * six SFT steps at TP=2 lower the loss and follow the LR schedule, and equal TP=1's losses.
"""
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_torchrun
from tests.megatron.schedule_script import VOCAB, make_sequences

SCRIPT = Path(__file__).with_name("schedule_script.py")
LAYOUTS = {"tp1": (1, ["--train"]), "tp2": (2, ["--tp", "2", "--train"]), "pp2": (2, ["--pp", "2"]), "dp2": (2, [])}

pytestmark = pytest.mark.slow  # each launch takes 15-45 s on a shared 2-core machine


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # far from the default init so a wrong mapping or a padded column shows
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("hf")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def results(hf_dir, tmp_path_factory):
    cache = {}

    def get(layout):
        if layout not in cache:
            nproc, extra = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(layout) / "out.pt"
            run_torchrun(SCRIPT, nproc, "--hf-dir", str(hf_dir), "--out", str(out), *extra)
            cache[layout] = torch.load(out, weights_only=False)
        return cache[layout]

    return get


def _max_diff(xs, ys):
    assert len(xs) == len(ys)
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys))


def test_log_probs_and_entropy_equal_hf(hf_dir, results):
    from transformers import Qwen2ForCausalLM

    hf = Qwen2ForCausalLM.from_pretrained(hf_dir).eval()
    got = results("tp1")
    for i, s in enumerate(make_sequences()):
        P, R = len(s.prompt_ids), len(s.response_ids)
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float() / 0.7, dim=-1)[P - 1: P + R - 1]  # (R, V)
        want = logp.gather(-1, ids[0, P:].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(got["log_probs"][i], want, atol=1e-4, rtol=0)
        torch.testing.assert_close(got["entropy"][i], -(logp.exp() * logp).sum(-1), atol=1e-4, rtol=0)
        assert got["values"][i].shape == (R,)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_forward_outputs_do_not_depend_on_layout(results, layout):
    ref, got = results("tp1"), results(layout)
    for key in ("log_probs", "entropy", "values"):
        assert _max_diff(ref[key], got[key]) < 1e-5, key
    assert float(ref["values"][0].abs().max()) > 0.1  # the value head was set: values are not trivially 0


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2", "dp2"])
def test_gradient_is_the_mini_batch_token_mean(results, layout):
    got = results(layout)
    one, three = got["grads"]["one"], got["grads"]["three"]
    scale = max(float(g.abs().max()) for g in one.values())
    assert scale > 1e-3
    for name in one:
        torch.testing.assert_close(three[name], one[name], atol=1e-5 * scale, rtol=1e-4)
    assert got["metrics"]["one"]["loss"] == pytest.approx(got["metrics"]["three"]["loss"], abs=1e-5)
    if layout != "pp2":  # rank 0 holds every parameter: compare with the single-process gradient
        ref = results("tp1")["grads"]["one"]
        assert sorted(ref) == sorted(one)
        for name in one:
            torch.testing.assert_close(one[name], ref[name], atol=1e-5 * scale, rtol=1e-4)
        assert got["metrics"]["one"]["loss"] == pytest.approx(results("tp1")["metrics"]["one"]["loss"], abs=1e-5)


def test_sft_steps_lower_the_loss_at_tp2(results):
    steps = results("tp2")["train"]
    losses = [m["loss"] for m in steps]
    assert losses[-1] < losses[0] - 1.0, losses
    assert [m["lr"] for m in steps[:3]] == pytest.approx([0.0, 3e-3, 3e-3 * 8 / 9])  # warmup 1, linear to 10
    assert all(m["update_successful"] == 1.0 and m["grad_norm"] > 0 for m in steps)
    assert all(abs(m["nll"] - m["loss"]) < 1e-4 for m in steps)  # token-weighted metric mean == the loss
    ref = [m["loss"] for m in results("tp1")["train"]]
    assert losses == pytest.approx(ref, abs=1e-4)
