"""The padded-vocabulary mask (rollout/engines/vllm_vocab_mask.py) through vLLM 0.32's own loaders, on the CPU.

GPUs with Triton run Model Runner V2, which checks `logits_processors` against its own base class when the engine is
built (the input processor's validator) and builds them with its own constructor arguments inside its sampler; the
CPU runs the V1 runner. Here the V2 classes run on the CPU (with the CPU patches vLLM's own CPU worker imports for V2):
the validator, `build_custom_logits_processors` and the V2 `Sampler` itself. The real CPU engine (V1) is checked
end to end in test_engines.py (test_vllm_never_samples_padded_rows)."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor  # noqa: E402

from megatron_searchr1.rollout.engines.vllm_vocab_mask import PaddedVocabMask  # noqa: E402

PAD_ROWS = 64
FQCN = "megatron_searchr1.rollout.engines.vllm_vocab_mask:PaddedVocabMask"


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory):
    """A tokenizer and a Qwen2 config with PAD_ROWS embedding rows past it (no weights: nothing here runs a model)."""
    from megatron_searchr1.models.tiny import TinyModelConfig, build_hf_config, train_tokenizer

    out = str(tmp_path_factory.mktemp("padded_vocab"))
    cfg = TinyModelConfig(output_dir=out, vocab_size=300)
    tok = train_tokenizer(cfg)
    tok.save_pretrained(out)
    build_hf_config(cfg, len(tok) + PAD_ROWS, tok.pad_token_id, tok.eos_token_id).save_pretrained(out)
    with open(os.path.join(out, "n_real.json"), "w") as f:
        json.dump(len(tok), f)
    return out


@pytest.fixture(scope="module")
def n_real(padded_dir):
    with open(os.path.join(padded_dir, "n_real.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def vllm_config(padded_dir):
    """vLLM's own config for that model, the mask named in it as VLLMEngine names it (the class itself)."""
    from vllm.engine.arg_utils import EngineArgs

    env = dict(os.environ)  # the CPU platform's config check sets process variables: put them back
    try:
        return EngineArgs(model=padded_dir, dtype="float32", max_model_len=64, enforce_eager=True,
                          logits_processors=[PaddedVocabMask]).create_engine_config()
    finally:
        os.environ.clear()
        os.environ.update(env)


class V1OnlyMask(V1LogitsProcessor):
    """The mask as it was: a V1-interface processor only (what Model Runner V2 refused at engine construction)."""

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        pass


def _v2_validator(processors):
    """vLLM's own InputProcessor method that picks and builds the request validator, as it runs with V2 chosen."""
    from vllm.v1.engine.input_processor import InputProcessor

    fake = SimpleNamespace(model_config=SimpleNamespace(logits_processors=processors, runner_type="generate"),
                           vllm_config=SimpleNamespace(use_v2_model_runner=True))
    return InputProcessor._build_logits_processors_params_validator(fake)


@pytest.mark.parametrize("named", [PaddedVocabMask, FQCN], ids=["class", "fqcn"])
def test_model_runner_v2_validator_accepts_the_mask(named):
    """The check that raised at engine construction on GPUs passes, for the class and for its qualified name."""
    validate = _v2_validator([named])
    validate(vllm.SamplingParams(temperature=0.0))  # per-request validation: nothing to refuse


def test_model_runner_v2_validator_refuses_a_v1_only_processor():
    """The class of bug this guards: a V1-only processor is refused by the V2 runner's validator."""
    with pytest.raises(ValueError, match="is not a subclass of vllm.v1.worker.gpu.sample.logits_processor"):
        _v2_validator([V1OnlyMask])


def _assert_masked(out: torch.Tensor, logits: torch.Tensor, n_real: int) -> None:
    assert out.shape == logits.shape and logits.shape[-1] == n_real + PAD_ROWS
    assert torch.isneginf(out[:, n_real:]).all(), "a padded id keeps a finite logit"
    assert torch.equal(out[:, :n_real], logits[:, :n_real]), "a real id's logit changed"


def test_model_runner_v2_sampler_masks_the_padded_ids(vllm_config, n_real):
    """Model Runner V2's loader builds the mask with its own arguments (vllm_config, req_states), and its Sampler's
    logits-processing stage then leaves -inf on exactly the ids >= the tokenizer's, for a greedy and a sampled
    request alike (V2 skips that stage for a batch no processor claims: greedy rows would come back unmasked)."""
    import vllm.v1.worker.cpu.shm  # noqa: F401  (vLLM's CPU worker imports it for V2: host buffers without pinning)
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.states import RequestState

    vocab = vllm_config.model_config.get_vocab_size()
    req_states = RequestState(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, num_speculative_steps=0,
                              vocab_size=vocab, device=torch.device("cpu"))
    procs = build_custom_logits_processors(vllm_config, req_states, False, vllm_config.model_config.logits_processors)
    assert [type(p) for p in procs] == [PaddedVocabMask]
    sampler = Sampler(vllm_config, 4, vocab, torch.device("cpu"), req_states, logprobs_mode="processed_logprobs",
                      custom_logits_processors=procs)
    for slot, temperature in enumerate((0.0, 1.0)):
        sampler.add_request(slot, vllm.SamplingParams(temperature=temperature))
    sampler.apply_staged_writes()
    rows = torch.tensor([0, 1], dtype=torch.int32)
    logits = torch.randn(2, vocab)
    out = sampler.apply_sampling_params(logits.clone(), rows, rows, rows.numpy(), torch.zeros(2, dtype=torch.int64),
                                        torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
                                        np.ones(2, dtype=np.int32), skip_top_k_top_p=True)
    _assert_masked(out, logits, n_real)


def test_v1_runner_builds_and_applies_the_mask(vllm_config, n_real):
    """The V1 runner's loader (the CPU backend's) builds the same class with its arguments; the mask is the same."""
    from vllm.v1.sample.logits_processor import build_logitsprocs

    built = build_logitsprocs(vllm_config, torch.device("cpu"), False, False,
                              vllm_config.model_config.logits_processors)
    mine = [p for p in built.all if isinstance(p, PaddedVocabMask)]
    assert len(mine) == 1 and mine[0] in built.non_argmax_invariant  # applied under greedy sampling too
    logits = torch.randn(3, n_real + PAD_ROWS)
    _assert_masked(mine[0].apply(logits.clone()), logits, n_real)
