"""Run by test_engines.py under `torchrun --nproc_per_node 2`: Megatron (gloo, tp=2) first, then one vLLM engine per
rank (external_launcher, vLLM TP=1) on rank-specific prompts; its greedy output must equal the hf engine's, and gloo
collectives must keep working afterwards."""
import sys

import torch
import torch.distributed as dist


def main(model_dir: str) -> None:
    from transformers import AutoTokenizer

    from megatron_searchr1.megatron.initialize import initialize_megatron
    from megatron_searchr1.rollout.engine import SamplingParams
    from megatron_searchr1.rollout.engines import make_engine

    initialize_megatron(tp=2)
    rank = dist.get_rank()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(t) for t in (["The capital of france is", "Water is"] if rank == 0 else ["how many", "<think>"])]
    params = SamplingParams(max_tokens=16, temperature=0)
    engine = make_engine("vllm", model_dir, dtype="float32", kv_cache_gib=0.25, seed=0)
    assert engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "external_launcher"
    outs = engine.generate(prompts, params)
    ref = make_engine("hf", model_dir).generate(prompts, params)
    assert [g.token_ids for g in outs] == [g.token_ids for g in ref], (rank, outs, ref)
    assert all(len(g.token_ids) == 16 for g in outs)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)  # the trainer's gloo world still works with vLLM living in the same processes
    assert x.item() == 3.0, x
    engine.sleep()
    engine.wake_up()
    print(f"RANK_OK {rank}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
