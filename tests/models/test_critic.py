"""Critic: the actor's trunk names, a (B, T) value output, a zero-init value head that learns, gradients to the trunk."""
from __future__ import annotations

import pytest
import torch

from megatron_searchr1.models.critic import VALUE_HEAD_BIAS, VALUE_HEAD_WEIGHT, build_critic_model
from megatron_searchr1.models.gpt import build_gpt_model
from tests.models.test_gpt import megatron_tp1, tiny_config  # noqa: F401  (fixture)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_critic_names_are_the_trunk_plus_value_head(megatron_tp1, kind):
    cfg = tiny_config(kind)
    critic = {n: p.shape for n, p in build_critic_model(cfg).named_parameters()}
    actor = {n: p.shape for n, p in build_gpt_model(cfg).named_parameters()}
    assert set(critic) == (set(actor) - {"output_layer.weight"}) | {VALUE_HEAD_WEIGHT, VALUE_HEAD_BIAS}
    assert critic[VALUE_HEAD_WEIGHT] == (1, cfg.hidden_size)
    for name in set(critic) & set(actor):
        assert critic[name] == actor[name], name


def test_values_shape_and_gradients(megatron_tp1):
    from megatron_searchr1.models.forward import forward_values

    critic = build_critic_model(tiny_config("qwen2"))
    ids = torch.randint(0, 250, (3, 10), generator=torch.Generator().manual_seed(0))
    values = critic(ids, None, None)
    assert values.shape == (3, 10) and values.dtype == torch.float32
    assert torch.all(values == 0)  # zero-initialised head: no random baseline before the first update

    target = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    ((values - target) ** 2).mean().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0
    assert critic.value_head.bias.grad.abs().sum() > 0

    # One SGD step on the head makes values depend on the input, and then the trunk receives gradients.
    with torch.no_grad():
        critic.value_head.weight -= 1.0 * critic.value_head.weight.grad
    critic.zero_grad(set_to_none=True)
    values = critic(ids, None, None)
    assert values.std() > 0
    ((values - target) ** 2).mean().backward()
    trunk = critic.decoder.layers[0].self_attention.linear_qkv.weight.grad
    assert trunk is not None and trunk.abs().sum() > 0
    assert critic.embedding.word_embeddings.weight.grad.abs().sum() > 0

    critic.eval()
    assert torch.allclose(forward_values(critic, ids), critic(ids, None, None))


def test_critic_sharded_state_dict_has_head_and_no_output_layer(megatron_tp1):
    critic = build_critic_model(tiny_config("llama"))
    keys = set(critic.sharded_state_dict().keys())
    assert {VALUE_HEAD_WEIGHT, VALUE_HEAD_BIAS} <= keys
    assert not any(k.startswith("output_layer") for k in keys)
