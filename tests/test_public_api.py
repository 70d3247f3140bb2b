"""The names the README calls public: each imports from where users' scripts import it, and a few behave as their
verl / Search-R1 namesakes do. When code moves inside the package, these imports must keep working."""
import inspect
import subprocess
import sys

import pytest

from tests.dist_utils import REPO

MODELS = ("build_gpt_model", "build_critic_model", "load_megatron_checkpoint", "hf_to_megatron", "megatron_to_hf",
          "forward_logits", "forward_values", "FAMILIES", "SUPPORTED_ARCHITECTURES", "get_family", "mapping_for",
          "read_dims", "ModelFamily", "ModelDims")
# verl's core_algos names (verl/trainer/ppo/core_algos.py) and verl.utils.torch_functional's masked helpers
ALGO_VERL = ("compute_gae_advantage_return", "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage",
             "compute_reinforce_plus_plus_outcome_advantage", "compute_policy_loss", "compute_value_loss",
             "compute_entropy_loss", "agg_loss", "kl_penalty", "FixedKLController", "AdaptiveKLController",
             "masked_mean", "masked_var", "masked_whiten", "entropy_from_logits")
# Search-R1's verl/utils/reward_score/qa_em.py
QA_EM_SEARCH_R1 = ("normalize_answer", "em_check", "subem_check", "extract_solution", "compute_score_em",
                   "compute_score_subem")


def test_models_public_names_import():
    import megatron_searchr1.models as models

    assert sorted(models.__all__) == sorted(MODELS)
    for name in set(MODELS) - {"FAMILIES", "SUPPORTED_ARCHITECTURES"}:  # defined in the package, not re-exported
        assert getattr(models, name).__module__.startswith("megatron_searchr1.models."), name
    assert isinstance(models.FAMILIES, tuple) and all(issubclass(f, models.ModelFamily) for f in models.FAMILIES)
    assert {f.__name__ for f in models.FAMILIES} == {"Qwen2Family", "Qwen3Family", "LlamaFamily", "MistralFamily",
                                                      "Qwen3MoeFamily", "Qwen2MoeFamily"}
    assert set(models.SUPPORTED_ARCHITECTURES) == {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM",
                                                   "MistralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"}
    from megatron_searchr1.models import build_gpt_model, forward_logits, get_family, load_megatron_checkpoint
    from megatron_searchr1.models.families import get_family as defined

    assert get_family is defined and callable(build_gpt_model) and callable(forward_logits)
    assert callable(load_megatron_checkpoint)
    assert models.get_family("Qwen2ForCausalLM").__name__ == "Qwen2Family"
    assert "LlamaForCausalLM" in models.SUPPORTED_ARCHITECTURES
    with pytest.raises(AttributeError, match="no attribute 'build_gtp_model'"):
        models.build_gtp_model  # noqa: B018  (a typo is an AttributeError, not a silent None)


def test_models_package_import_stays_light():
    """The converters' and tiny-model CLIs live in megatron_searchr1.models: importing the package must not load
    torch, so those CLIs check their flags before the heavy imports (tests/test_cli.py times them)."""
    code = ("import sys, megatron_searchr1.models, megatron_searchr1.models.convert_cli, megatron_searchr1.reward; "
            "print(sorted(m for m in ('torch', 'megatron.core', 'vllm') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_algo_has_verls_names_and_argument_order():
    import megatron_searchr1.algo as algo

    for name in ALGO_VERL:
        assert name in algo.__all__ and callable(getattr(algo, name)), name
    # verl's leading arguments, in verl's order (what a user's call with positional arguments relies on)
    leading = {
        "compute_gae_advantage_return": ["token_level_rewards", "values", "response_mask", "gamma", "lam"],
        "compute_grpo_outcome_advantage": ["token_level_rewards", "response_mask", "index", "epsilon",
                                           "norm_adv_by_std_in_grpo"],
        "compute_policy_loss": ["old_log_prob", "log_prob", "advantages", "response_mask", "cliprange",
                                "cliprange_low", "cliprange_high", "clip_ratio_c", "loss_agg_mode"],
        "compute_value_loss": ["vpreds", "returns", "values", "response_mask", "cliprange_value", "loss_agg_mode"],
        "kl_penalty": ["logprob", "ref_logprob", "kl_penalty"],
        "agg_loss": ["loss_mat", "loss_mask", "loss_agg_mode"],
    }
    for name, args in leading.items():
        params = list(inspect.signature(getattr(algo, name)).parameters)
        assert params[:len(args)] == args, (name, params)


def test_algo_functions_behave_as_verl_documents():
    torch = pytest.importorskip("torch")
    from megatron_searchr1.algo import agg_loss, compute_grpo_outcome_advantage, compute_policy_loss, kl_penalty

    # GRPO: a group's scores (1, 0) whiten to +-1/sqrt(2) * sqrt(2) ... by hand: mean 0.5, std 0.7071
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    adv, returns = compute_grpo_outcome_advantage(rewards, torch.ones(2, 2), ["q", "q"])
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, -0.5]) / 0.70710678, atol=1e-4)
    assert torch.equal(adv, returns)
    # k3 of log-prob 0 against a reference of ln 0.5: e^d - d - 1 with d = ln 0.5
    d = torch.log(torch.tensor(0.5))
    assert torch.isclose(kl_penalty(torch.tensor([0.0]), d.reshape(1), "low_var_kl"), torch.exp(d) - d - 1).all()
    # ratio 1 everywhere: the clipped surrogate is -mean(advantage), nothing clipped
    lp = torch.zeros(2, 3)
    pg_loss, clipfrac, ppo_kl, _ = compute_policy_loss(lp, lp, torch.tensor([[1.0, 2, 3], [4, 5, 6]]),
                                                       torch.ones(2, 3), cliprange=0.2)
    assert pg_loss.item() == pytest.approx(-3.5) and clipfrac.item() == 0 and ppo_kl.item() == 0
    assert agg_loss(torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 0.0]]), "token-mean").item() == 1.0


def test_reward_qa_em_has_search_r1s_names_and_results():
    from megatron_searchr1.reward import qa_em

    for name in QA_EM_SEARCH_R1:
        assert callable(getattr(qa_em, name)), name
    assert qa_em.normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert qa_em.em_check("the Eiffel tower", ["Eiffel Tower", "Paris"]) == 1
    assert qa_em.em_check("Eiffel", ["Eiffel Tower"]) == 0
    assert qa_em.subem_check("it is the Eiffel Tower in Paris", ["Eiffel Tower"]) == 1
    assert qa_em.extract_solution("<think> x </think> <answer> Paris </answer>") == "Paris"
    assert qa_em.extract_solution("no answer here") is None
    gt = {"target": ["Paris"]}
    assert qa_em.compute_score_em("<answer> paris </answer>", gt) == 1.0
    assert qa_em.compute_score_em("<answer> Lyon </answer>", gt, format_score=0.1) == 0.1
    assert qa_em.compute_score_subem("<answer> in Paris, France </answer>", gt) == 1.0


def test_megatron_initialize_is_importable():
    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron

    assert callable(initialize_megatron) and callable(destroy_megatron)
    assert {"tp", "pp", "seed"} <= set(inspect.signature(initialize_megatron).parameters)


def test_readme_lists_the_same_public_names():
    """The README's "Public names" section and the code agree: the models bullet names exactly models.__all__,
    and every algo / qa_em name it gives exists."""
    import re

    import megatron_searchr1.algo as algo
    import megatron_searchr1.models as models
    from megatron_searchr1.reward import qa_em

    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Public names"):]
    section = section[:section.index("\n## ", 1)]
    bullets = {b.split("`", 2)[1]: set(re.findall(r"`(\w+)`", b)) for b in section.split("\n- ")[1:]}
    assert bullets["megatron_searchr1.models"] == set(models.__all__)
    assert bullets["megatron_searchr1.algo"] - {"core_algos"} <= set(algo.__all__)
    assert all(callable(getattr(qa_em, name)) for name in bullets["megatron_searchr1.reward.qa_em"])
