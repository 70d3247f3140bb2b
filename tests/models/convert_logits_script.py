# torchrun --nproc_per_node 2 tests/models/convert_logits_script.py --hf-dirs HF/qwen2 HF/qwen3 \
#     --ckpt-dirs C/qwen2 C/qwen3 --cases 2x1 1x2f1@qwen3 [--sync-hf-dirs HF/a HF/b --sync 1x2f1=state_dict]
"""Converted Megatron model logits vs the HF `transformers` model's, at the given TP x PP cases (world = TP*PP).

A case is `TPxPP`, or `TPxPPfN` for an uneven pipeline split with N layers on the first stage
(num_layers_in_first_pipeline_stage), optionally followed by `@NAME,NAME`: only the HF dirs with those base names
(default: all), so cases that check different models share one launch. For every HF dir and case: build the
Megatron stage, fill it from the HF safetensors through the family mapping, and compare the full-vocabulary logits
with HF's (fp32, max abs diff <= 1e-4); export the stage back to HF names (`gather_hf_weights`) and check every
tensor is bit-identical to the HF file and every HF tensor comes back exactly once; then check that deliberately
wrong mappings (no QKV interleave; gate/up swapped) FAIL the logits comparison; then load the converter's dist
checkpoint (saved at TP=1 PP=1) at this case's TP/PP and compare again. Prints one `RESULT ...` line per check
(tagged with its case) from the last stage's first TP rank.

`--sync LAYOUT=ENGINE` also runs the weight sync's checks (tests/rollout/weight_sync_script.py, rows tagged with
`engine`) on `--sync-hf-dirs` right after the convert checks of the case with that layout, in the same processes and
Megatron world: the convert and weight-sync tests of one world size share one launch (tests/models/launches.py),
whose start (torch, Megatron and transformers imports, the process group) costs more than most of their checks.
"""
import argparse
import json
import os

import torch

from megatron_searchr1.models.families import stack_gate_up

TOL = 1e-4


def wrong_mappings(family):
    """Two plausible bugs a mapping could have, as subclasses of the right family."""

    class NoInterleave(family):
        def hf_to_megatron(self, name, hf_tensors):
            if "linear_qkv" in name:  # plain [q; k; v] instead of per-group [q_g; k_g; v_g]
                return torch.cat([hf_tensors[s] for s in self.hf_sources(name)], dim=0)
            return super().hf_to_megatron(name, hf_tensors)

    class UpGateSwapped(family):
        def hf_to_megatron(self, name, hf_tensors):
            if "linear_fc1" in name:
                gate, up = (hf_tensors[s] for s in self.hf_sources(name))
                return stack_gate_up(up, gate)
            return super().hf_to_megatron(name, hf_tensors)

    return {"no_qkv_interleave": NoInterleave, "up_gate_swapped": UpGateSwapped}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dirs", nargs="+", required=True)
    p.add_argument("--ckpt-dirs", nargs="+", required=True, help="hf_to_megatron output for each HF dir")
    p.add_argument("--cases", nargs="+", required=True, help="TPxPP[fN][@NAME,...], e.g. 2x1 1x2f1@qwen3")
    p.add_argument("--sync-hf-dirs", nargs="+", default=[], help="models of the weight-sync checks")
    p.add_argument("--sync", nargs="+", default=[], metavar="LAYOUT=ENGINE",
                   help="after the case of LAYOUT (TPxPP[fN]), the weight-sync checks with --engine ENGINE")
    a = p.parse_args()
    syncs = dict(item.split("=") for item in a.sync)
    assert set(syncs) <= {c.partition("@")[0] for c in a.cases}, f"--sync {a.sync}: a layout with no case"

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_searchr1.megatron.initialize import destroy_megatron, initialize_megatron
    from megatron_searchr1.models.convert import (
        SafetensorsReader, bind_mapping, gather_hf_weights, load_hf_weights, load_megatron_checkpoint,
    )
    from megatron_searchr1.models.families import get_family
    from megatron_searchr1.models.forward import forward_logits
    from megatron_searchr1.models.gpt import build_gpt_model, transformer_config_from_hf

    for case in a.cases:
        layout, _, wanted = case.partition("@")
        dirs = [(h, c) for h, c in zip(a.hf_dirs, a.ckpt_dirs)
                if not wanted or os.path.basename(h) in wanted.split(",")]
        assert dirs, f"case {case}: no --hf-dirs named {wanted}"
        tp, rest = layout.split("x")
        pp, _, first = rest.partition("f")
        tp, pp, first = int(tp), int(pp), (int(first) if first else None)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        initialize_megatron(tp=tp, pp=pp)
        report = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

        for hf_dir, ckpt_dir in dirs:
            hf_config = AutoConfig.from_pretrained(hf_dir)
            arch = hf_config.architectures[0]
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, hf_config.vocab_size, (2, 16), generator=g)
            hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
            with torch.no_grad():
                ref = hf_model(ids).logits.float()

            def check(model, label, expect_match):
                logits = forward_logits(model, ids)
                if logits is None:
                    return
                assert logits.shape == ref.shape, (logits.shape, ref.shape)
                diff = (logits.float() - ref).abs().max().item()
                ok = diff <= TOL if expect_match else diff > TOL
                if report:
                    row = dict(case=case, arch=arch, tp=tp, pp=pp, check=label, diff=diff, ok=ok)
                    print("RESULT " + json.dumps(row), flush=True)
                assert ok, f"{arch} TP={tp} PP={pp} {label}: max abs diff {diff} (expect_match={expect_match})"

            def build():
                overrides = {} if first is None else {"num_layers_in_first_pipeline_stage": first}
                config = transformer_config_from_hf(hf_config, tp=tp, pp=pp, **overrides)
                return build_gpt_model(hf_config, config=config).eval()

            reader = SafetensorsReader(hf_dir)
            model = build()
            if first is not None and ps.get_pipeline_model_parallel_rank() == 0:
                assert len(model.decoder.layers) == first, len(model.decoder.layers)
            mapping = bind_mapping(hf_config, model)
            load_hf_weights(model, reader, mapping)
            check(model, "hf_weights", True)

            # Megatron -> HF names again: bit-identical, and over all stages every HF tensor exactly once.
            exported = dict(gather_hf_weights(model, mapping))
            bad = sorted(n for n, t in exported.items() if not torch.equal(t, reader.get(n)))
            names = [None] * dist.get_world_size()
            dist.all_gather_object(names, sorted(exported) if ps.get_tensor_model_parallel_rank() == 0 else [])
            listed = [n for part in names for n in part]
            exact = not bad and sorted(listed) == sorted(reader.names())
            if report:
                print("RESULT " + json.dumps(dict(case=case, arch=arch, tp=tp, pp=pp, check="gather_round_trip",
                                                  diff=0.0, ok=exact, bad=bad[:4])), flush=True)
            assert exact, f"{arch} TP={tp} PP={pp}: exported tensors differ {bad[:4]} or names {len(listed)}"
            for label, cls in wrong_mappings(get_family(hf_config)).items():
                load_hf_weights(model, reader, bind_mapping(hf_config, model, mapping_cls=cls))
                check(model, label, False)

            fresh = build()
            load_megatron_checkpoint(fresh, ckpt_dir)
            check(fresh, "dist_checkpoint_tp1", True)
        dist.barrier()
        if layout in syncs:
            weight_sync_checks(a.sync_hf_dirs, tp, pp, first, syncs.pop(layout))
    destroy_megatron()


def weight_sync_checks(hf_dirs, tp, pp, first, engine):
    """weight_sync_script.py's checks at this layout, in the world the case left (its main() minus the start)."""
    from tests.rollout.weight_sync_script import state_dict_checks, vllm_checks

    args = argparse.Namespace(hf_dirs=hf_dirs, tp=tp, pp=pp, ep=1, first_stage_layers=first, bucket_bytes=16 << 10,
                              engine=engine)
    if engine in ("state_dict", "both"):
        state_dict_checks(args)
    if engine in ("vllm", "both"):
        vllm_checks(args, hf_dirs[:1] if engine == "both" else hf_dirs)


if __name__ == "__main__":
    main()
