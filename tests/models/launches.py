"""The tiny models and the torchrun launches that the convert tests (tests/models/test_convert.py) and the weight-sync
tests (tests/rollout/test_weight_sync.py) share: one launch per world size (1, 2 and 4 ranks) runs
convert_logits_script.py's cases and, in the same processes, the weight sync's checks at one of their layouts.
Starting 4 ranks (torch, Megatron, transformers, the process group) costs more than most checks, so the two test
files pay for it once. Each launch runs on first use and its output is kept for the rest of the session, whichever
file asks first; `rank_results` reads it (convert rows carry a `case`, weight-sync rows an `engine`).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
from tests.dist_utils import REPO, run_torchrun

SCRIPT = Path(__file__).with_name("convert_logits_script.py")

CONVERT_FAMILIES = (("qwen2", False, 0), ("llama", True, 1), ("qwen3", True, 2), ("mistral", False, 3))
"""(arch, tied embeddings, seed) of the convert tests' models."""
ALL = tuple(a for a, _, _ in CONVERT_FAMILIES)
TP2_AND_PP2 = {"2x1": ("qwen2", "llama"), "1x2": ("qwen2", "llama")}
UNEVEN_PP2 = {"1x2f1": ("qwen2", "qwen3"), "1x2f3": ("qwen2", "qwen3")}
CONVERT_CASES = {1: {"1x1": ALL}, 2: {**TP2_AND_PP2, **UNEVEN_PP2}, 4: {"2x2": ALL}}
"""World size -> the convert cases ({case: archs}) of its launch."""


def weight_sync_layouts() -> dict[int, str]:
    """World size -> LAYOUT=ENGINE of the weight-sync checks in its launch: the state-dict engine at TP=PP=1, the
    uneven pipeline split (1 + 3 layers at PP=2), and TP=2 x PP=2 into both engines (the state dict alone where vLLM
    is not installed: the weight-sync test skips then, the convert test still runs)."""
    four = "both" if importlib.util.find_spec("vllm") is not None else "state_dict"
    return {1: "1x1=state_dict", 2: "1x2f1=state_dict", 4: f"2x2={four}"}


_cache: dict = {}


def _once(key, make):
    """make() the first time `key` is asked for; its value, or the error it raised, every time after (a failed launch
    fails both files' tests without running again)."""
    if key not in _cache:
        try:
            _cache[key] = (make(), None)
        except Exception as e:  # noqa: BLE001 (raised again to every test that asks)
            _cache[key] = (None, e)
    value, error = _cache[key]
    if error is not None:
        raise error
    return value


def _convert_all(pairs, tmp_dir) -> None:
    """The converter's command line (checkpoints_convert/hf_to_megatron.py's main) for each (hf_dir, out_dir), all
    in one process: starting torch and Megatron costs more than converting a tiny model."""
    script = os.path.join(tmp_dir, "convert_all.py")
    with open(script, "w") as f:
        f.write("import sys\n"
                "from megatron_searchr1.models.convert_cli import hf_to_megatron_main\n"
                "if __name__ == '__main__':  # dist_checkpointing starts worker processes\n"
                "    for hf_dir, out_dir in zip(sys.argv[1::2], sys.argv[2::2]):\n"
                "        assert hf_to_megatron_main(['--hf-dir', hf_dir, '--out-dir', out_dir]) == 0\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, script, *(d for pair in pairs for d in pair)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def convert_models(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """arch -> (HF dir, its TP1 checkpoint): Qwen2 (untied, qkv bias), Llama (tied), Qwen3 (tied, q/k norms) and
    Mistral (untied) with 4 layers, 4 heads, 2 kv heads. init_std 0.1 gives logits of order 1, so a wrong mapping
    moves them by far more than the 1e-4 tolerance."""
    def make():
        root = tmp_path_factory.mktemp("convert")
        out = {}
        for arch, tie, seed in CONVERT_FAMILIES:
            hf = str(root / arch)
            make_tiny_model(TinyModelConfig(output_dir=hf, arch=arch, num_layers=4, num_heads=4, num_kv_heads=2,
                                            hidden_size=64, intermediate_size=128, tie_embeddings=tie, init_std=0.1,
                                            seed=seed))
            out[arch] = (hf, str(root / f"{arch}-mcore"))
        _convert_all(out.values(), str(root))
        return out

    return _once("convert_models", make)


def sync_models(tmp_path_factory) -> list[str]:
    """The weight sync's Qwen2s, untied and tied: hidden 64, 2 heads of 32, 1 kv head, 4 layers, init_std 0.1 for
    order-1 logits, a vocab of 500 (not a multiple of Megatron's padding, so the sync's trim runs)."""
    def make():
        root = tmp_path_factory.mktemp("wsync")
        dirs = []
        for tie, seed in ((False, 0), (True, 1)):
            d = str(root / f"qwen2-{'tied' if tie else 'untied'}")
            make_tiny_model(TinyModelConfig(output_dir=d, arch="qwen2", hidden_size=64, num_heads=2, num_kv_heads=1,
                                            intermediate_size=128, num_layers=4, tie_embeddings=tie, init_std=0.1,
                                            seed=seed, vocab_size=500))
            dirs.append(d)
        return dirs

    return _once("sync_models", make)


def launch(tmp_path_factory, nproc: int) -> str:
    """The output of the shared launch of `nproc` ranks: its convert cases (CONVERT_CASES), then at one of them the
    weight sync's checks (weight_sync_layouts)."""
    def run():
        models, cases = convert_models(tmp_path_factory), CONVERT_CASES[nproc]
        archs = [a for a in ALL if any(a in want for want in cases.values())]
        args = ["--hf-dirs", *(models[a][0] for a in archs), "--ckpt-dirs", *(models[a][1] for a in archs),
                "--cases", *(f"{case}@{','.join(want)}" for case, want in cases.items()),
                "--sync-hf-dirs", *sync_models(tmp_path_factory), "--sync", weight_sync_layouts()[nproc]]
        return run_torchrun(SCRIPT, nproc, *args, timeout=900, env=dict(VLLM_ENABLE_V1_MULTIPROCESSING="0"))

    return _once(("launch", nproc), run)
