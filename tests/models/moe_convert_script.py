# torchrun --nproc_per_node 4 tests/models/moe_convert_script.py --mode to_megatron --tp 2 --ep 2 --hf-dirs H \
#     --ckpt-dirs C
"""MoE conversion under torchrun (gloo): the real converter at one TP x PP x EP layout, then Megatron's logits and
router aux loss against transformers' on the converted weights.

--mode to_megatron: convert.hf_to_megatron(HF -> dist checkpoint) at this layout, load the checkpoint into a fresh
  model, compare the full-vocabulary logits with HF's (fp32, max abs diff <= 1e-5).
--mode to_hf: convert.megatron_to_hf(dist checkpoint -> HF dir) at this layout (the test compares the files with the
  original bit for bit), and the logits check on the checkpoint loaded at this layout.
At TP=1, also each MoE layer's load-balancing loss (Megatron's router in train mode on the hidden states the
forward routed, its tracker summed over stages) next to transformers' `load_balancing_loss_func` on that layer's
router logits (the test compares them).
Prints one `RESULT {json}` line per check from global rank 0 (PP: the last stage's first rank reports logits).
"""
import argparse
import json

import torch

TOL = 1e-5


def report(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["to_megatron", "to_hf"], required=True)
    p.add_argument("--hf-dirs", nargs="+", required=True)
    p.add_argument("--ckpt-dirs", nargs="+", required=True)
    p.add_argument("--out-dirs", nargs="*", default=[])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    a = p.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker, reduce_aux_losses_tracker_across_ranks,
    )
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_searchr1.megatron.initialize import destroy_megatron
    from megatron_searchr1.models import convert_megatron as convert
    from megatron_searchr1.models.forward import forward_logits
    from megatron_searchr1.models.gpt import build_gpt_model

    layout = dict(tp=a.tp, pp=a.pp, ep=a.ep)
    for i, (hf_dir, ckpt_dir) in enumerate(zip(a.hf_dirs, a.ckpt_dirs)):
        if a.mode == "to_megatron":
            convert.hf_to_megatron(hf_dir, ckpt_dir, overwrite=True, **layout)
        else:
            convert.megatron_to_hf(ckpt_dir, a.out_dirs[i], overwrite=True, **layout)
        rank = dist.get_rank()
        hf_config = AutoConfig.from_pretrained(hf_dir)
        arch = hf_config.architectures[0]
        ids = torch.randint(0, hf_config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(i))
        # eager: transformers' grouped_mm experts need 16-byte strides, which odd widths do not have
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, experts_implementation="eager")
        with torch.no_grad():
            hf_out = hf_model(ids, output_router_logits=True)

        model = build_gpt_model(hf_config).eval()
        convert.load_megatron_checkpoint(model, ckpt_dir)
        logits = forward_logits(model, ids)
        if logits is not None:
            diff = (logits.float() - hf_out.logits.float()).abs().max().item()
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                print("RESULT " + json.dumps(dict(arch=arch, mode=a.mode, check="logits", diff=diff,
                                                  ok=diff <= TOL, **layout)), flush=True)
            assert diff <= TOL, f"{arch} {layout}: logits differ by {diff}"

        if a.tp == 1:
            from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

            # The router's aux loss on the hidden states the eval forward routed (Megatron computes it only in
            # training; training MoE under TP needs sequence parallelism, so this check runs at TP=1).
            routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
            inputs = []
            hooks = [r.register_forward_pre_hook(lambda m, args, kw: inputs.append((m, args[0])), with_kwargs=True)
                     for r in routers]
            forward_logits(model, ids)
            for h in hooks:
                h.remove()
            clear_aux_losses_tracker()
            with torch.enable_grad():
                for router, hidden in inputs:
                    router.train()(hidden)
            reduce_aux_losses_tracker_across_ranks()  # sums the pipeline stages' layers
            values = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].detach().clone()
            moe_layers = [j for j in range(hf_config.num_hidden_layers) if values[j] != 0]
            e, k = model.config.num_moe_experts, model.config.moe_router_topk
            hf_layer = [load_balancing_loss_func((lg,), e, k).item() for lg in hf_out.router_logits]
            if rank == 0:
                report(arch=arch, check="aux_loss", megatron=values[moe_layers].tolist(), hf_per_layer=hf_layer,
                       hf_pooled=load_balancing_loss_func(hf_out.router_logits, e, k).item(),
                       hf_model_aux_loss=hf_out.aux_loss.item(), topk=k, moe_layers=moe_layers, **layout)
        dist.barrier()
    destroy_megatron()


if __name__ == "__main__":
    main()
