"""Critic: the actor's trunk names, a (B, T) value output, a zero-init value head that learns, gradients to the trunk."""
from __future__ import annotations

import os

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


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True)])
def test_critic_starts_from_actor_hf_dir_and_converted_checkpoint(megatron_tp1, tmp_path, arch, tie):
    """PPO's critic starts from the actor: trunk = the actor's weights, value head zero (absent from both sources)."""
    from megatron.core import dist_checkpointing

    from megatron_searchr1.models.convert import (
        SafetensorsReader, bind_mapping, load_hf_config, load_hf_weights, load_megatron_checkpoint,
    )
    from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model

    hf = make_tiny_model(TinyModelConfig(output_dir=str(tmp_path / "hf"), arch=arch, tie_embeddings=tie,
                                         vocab_size=300, seed=0))
    cfg = load_hf_config(hf)
    actor = build_gpt_model(cfg)
    load_hf_weights(actor, SafetensorsReader(hf), bind_mapping(cfg, actor))
    ckpt = str(tmp_path / "ckpt")  # what hf_to_megatron writes: the actor's sharded state dict
    os.makedirs(ckpt)
    dist_checkpointing.save(actor.sharded_state_dict(), ckpt)
    actor_params = dict(actor.named_parameters())

    from_hf = build_critic_model(cfg)
    load_hf_weights(from_hf, SafetensorsReader(hf), bind_mapping(cfg, from_hf))
    from_ckpt = build_critic_model(cfg)
    with torch.no_grad():  # a fresh build is random: loading must overwrite every trunk tensor
        for p in from_ckpt.parameters():
            p.add_(1.0)
        from_ckpt.value_head.weight.zero_()
        from_ckpt.value_head.bias.zero_()
    load_megatron_checkpoint(from_ckpt, ckpt)
    for critic in (from_hf, from_ckpt):
        params = dict(critic.named_parameters())
        trunk = set(params) - {VALUE_HEAD_WEIGHT, VALUE_HEAD_BIAS}
        assert trunk == set(actor_params) - {"output_layer.weight"}
        for name in trunk:
            assert torch.equal(params[name], actor_params[name]), name
        assert torch.all(critic.value_head.weight == 0) and torch.all(critic.value_head.bias == 0)


def test_critic_checkpoint_missing_a_trunk_tensor_is_refused(megatron_tp1, tmp_path):
    """Only value_head.* may be missing: a checkpoint without a trunk tensor is still an error."""
    from megatron.core import dist_checkpointing

    from megatron_searchr1.models.convert import ConversionError, load_megatron_checkpoint

    cfg = tiny_config("qwen2")
    actor = build_gpt_model(cfg)
    sharded = {k: v for k, v in actor.sharded_state_dict().items() if k != "decoder.final_layernorm.weight"}
    os.makedirs(tmp_path / "ckpt")
    dist_checkpointing.save(sharded, str(tmp_path / "ckpt"))
    with pytest.raises(ConversionError, match="decoder.final_layernorm.weight"):
        load_megatron_checkpoint(build_critic_model(cfg), str(tmp_path / "ckpt"))
