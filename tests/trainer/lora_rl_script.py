# torchrun --nproc_per_node 2 -m tests.trainer.lora_rl_script CONFIG.yaml model.lora.rank=4 KEY=VALUE ...
"""LoRA RL end to end on real ranks (test_lora_rl.py's worker): the RL trainer exactly as train.py runs it, with
checks around `fit()` that need the live models. Prints one `RESULT {json}` line per rank:

- base_identical: every base parameter of this rank's actor stage equals, bit for bit, its value before RL;
- adapters_moved: some adapter tensor changed; optimizer_numel / adapter_numel: what the optimizer holds;
- ref_vs_base: max |reference log-prob - log-prob of a freshly loaded base model| on fixed sequences (0 expected);
  actor_vs_base: the same for the trained actor (the adapters moved it);
- ref_model: what the generation offload holds as the reference model (None: there is no second model).
"""
import json
import sys

import torch


def main(argv):
    import torch.distributed as dist

    from megatron_searchr1.cli import check_retrieval, parse
    from megatron_searchr1.megatron.batching import TrainSequence
    from megatron_searchr1.models.gpt import model_settings
    from megatron_searchr1.models.lora import is_lora_param, lora_parameters
    from megatron_searchr1.models.forward import unwrap
    from megatron_searchr1.trainer.rl import Trainer
    from megatron_searchr1.trainer.sources import weights_loader
    from megatron_searchr1.trainer.roles import Policy, build_reference

    cfg = parse(argv)
    check_retrieval(cfg)
    trainer = Trainer(cfg)
    policy, reference = trainer.policy, trainer.reference
    bare = unwrap(policy.model)
    before = {n: p.detach().clone() for n, p in bare.named_parameters() if not is_lora_param(n)}
    adapters_before = {n: p.detach().clone() for n, p in bare.named_parameters() if is_lora_param(n)}
    try:
        trainer.fit()
        after = dict(bare.named_parameters())
        identical = all(torch.equal(after[n].detach(), t) for n, t in before.items())
        moved = any(not torch.equal(after[n].detach(), t) for n, t in adapters_before.items())
        held = sum(p.numel() for g in policy.optimizer.param_groups for p in g["params"])

        settings = model_settings(policy.hf_config, tp=cfg.parallel.tp, pp=cfg.parallel.pp, params_dtype=policy.dtype,
                                  use_te=False)
        base = build_reference(policy.hf_config, **settings, load_weights=weights_loader(policy.hf_config,
                                                                                         policy.source))
        g = torch.Generator().manual_seed(0)
        vocab = policy.hf_config.vocab_size
        seqs = [TrainSequence(prompt_ids=torch.randint(0, vocab, (6,), generator=g).tolist(),
                              response_ids=torch.randint(0, vocab, (10,), generator=g).tolist(),
                              loss_mask=torch.ones(10)) for _ in range(4)]
        base_lp = Policy(base).log_probs(seqs, max_tokens_per_micro_batch=1024)
        ref_lp = reference.log_probs(seqs, 1024, 1.0)
        actor_lp = policy.log_probs(seqs, 1024, 1.0)
        gap = lambda xs: max((x - b).abs().max().item() for x, b in zip(xs, base_lp))  # noqa: E731
        offload = trainer.worker.offload
        print("RESULT " + json.dumps(dict(
            rank=dist.get_rank(), base_identical=identical, base_tensors=len(before), adapters_moved=moved,
            optimizer_numel=held, adapter_numel=sum(p.numel() for p in lora_parameters(policy.model)),
            ref_vs_base=gap(ref_lp), actor_vs_base=gap(actor_lp),
            ref_model=None if getattr(offload, "ref", None) is None else type(offload.ref).__name__)), flush=True)
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
