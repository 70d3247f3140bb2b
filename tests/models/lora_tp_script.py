# torchrun --nproc_per_node 2 tests/models/lora_tp_script.py --hf-dir HF --inputs inputs.pt --out OUT
"""LoRA at TP=2 and PP=2 (test_lora.py's torchrun worker): the adapter from `inputs.pt` (full tensors) loaded onto
the shards / stages; writes OUT/{tp2,tp2sp,pp2}.pt (logits and gathered adapter gradients: TP=2 without and with
sequence parallelism, PP=2 through Megatron's pipeline schedule) and a PEFT adapter dir and a merged HF export from
the TP=2 model (OUT/adapter, OUT/merged) and from the PP=2 one (OUT/pp2_adapter, OUT/pp2_merged). test_lora.py
compares all of it with TP=1. Adapter checkpoints: the TP=1 one (--ckpt) loads here at TP=2 and at PP=2 with the
same tensors, and the TP=2 one is written to OUT/ckpt_tp2 for test_lora.py to load at TP=1.

With sequence parallelism a column adapter's A sees only this rank's tokens, so its gradient is summed over TP for
parameters marked `sequence_parallel`, what Megatron's finalize_model_grads does inside wrap_ddp's training step.
"""
import argparse
import os

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True, help="an adapter checkpoint saved at TP=1")
    a = p.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron
    from megatron.core import dist_checkpointing

    from megatron_searchr1.models.lora import (
        LoraSettings, adapter_sharded_state_dict, apply_lora, gather_adapter_state, load_adapter_state,
    )
    from megatron_searchr1.models.lora_export import export_merged_hf, write_peft_adapter
    from tests.models.test_lora import build_base, logits_of, loss_of

    initialize_megatron(tp=2, pp=1)
    cfg = AutoConfig.from_pretrained(a.hf_dir)
    inputs = torch.load(a.inputs)
    settings = LoraSettings(rank=4, alpha=8, targets=("all",))
    os.makedirs(a.out, exist_ok=True)
    for case, overrides in (("tp2", {}), ("tp2sp", {"sequence_parallel": True})):
        model = build_base(cfg, a.hf_dir, **overrides)
        apply_lora(model, settings)
        load_adapter_state(model, inputs["state"])
        logits = logits_of(model, inputs["ids"])
        loss_of(logits).backward()
        if overrides:
            for param in model.parameters():
                if param.grad is not None and getattr(param, "sequence_parallel", False):
                    dist.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())
        grads = gather_adapter_state(model, grad=True)
        if dist.get_rank() == 0:
            torch.save(dict(logits=logits.detach(), grads=grads), os.path.join(a.out, f"{case}.pt"))
        if case == "tp2":
            check_adapter_checkpoint(cfg, a, settings, inputs["state"])
            if dist.get_rank() == 0:
                os.makedirs(os.path.join(a.out, "ckpt_tp2"))
            dist.barrier()
            dist_checkpointing.save(adapter_sharded_state_dict(model), os.path.join(a.out, "ckpt_tp2"))
            write_peft_adapter(model, os.path.join(a.out, "adapter"), base_model_name_or_path=a.hf_dir)
            export_merged_hf(model, cfg, a.hf_dir, os.path.join(a.out, "merged"))

    ps.destroy_model_parallel()  # keep the process group, regroup the same two ranks as PP=2
    initialize_megatron(tp=1, pp=2)
    check_adapter_checkpoint(cfg, a, settings, inputs["state"])
    model = build_base(cfg, a.hf_dir)
    apply_lora(model, settings)
    load_adapter_state(model, inputs["state"])
    logits = pipeline_forward_backward(model, inputs["ids"], logits_of, loss_of)
    stage_grads = [None] * dist.get_world_size()
    dist.all_gather_object(stage_grads, gather_adapter_state(model, grad=True))
    if ps.is_pipeline_last_stage():
        torch.save(dict(logits=logits, grads={k: v for g in stage_grads for k, v in g.items()}),
                   os.path.join(a.out, "pp2.pt"))
    write_peft_adapter(model, os.path.join(a.out, "pp2_adapter"), base_model_name_or_path=a.hf_dir)
    export_merged_hf(model, cfg, a.hf_dir, os.path.join(a.out, "pp2_merged"))
    dist.barrier()
    if dist.get_rank() == 0:
        print("LORA_TP_OK", flush=True)
    destroy_megatron()


def check_adapter_checkpoint(cfg, a, settings, state):
    """The TP=1 adapter checkpoint loads into a fresh adapter at this TP/PP with exactly `state`'s tensors."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_searchr1.models.lora import adapter_sharded_state_dict, apply_lora, gather_adapter_state
    from tests.models.test_lora import build_base

    model = build_base(cfg, a.hf_dir)
    apply_lora(model, settings)
    result = model.load_state_dict(dist_checkpointing.load(adapter_sharded_state_dict(model), a.ckpt), strict=False)
    assert not [k for k in result.missing_keys if ".lora." in k] and not result.unexpected_keys, result
    got = gather_adapter_state(model)
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, sorted(got))
    assert sorted({k for s in stages for k in s}) == sorted(state)
    assert all(torch.equal(t, state[k]) for k, t in got.items())


def pipeline_forward_backward(model, ids, logits_of, loss_of):
    """One forward and backward of `loss_of(logits)` through Megatron's pipeline schedule (one micro-batch); the
    logits on the last stage, None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    kept = []

    def forward_step(data_iterator, model_chunk):
        logits = logits_of(model_chunk, next(data_iterator))

        def loss_func(output):
            kept.append(output.detach())
            return loss_of(output), {}

        return logits, loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ids]), model=[model],
                                num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                forward_only=False)
    return kept[0] if kept else None


if __name__ == "__main__":
    main()
