"""Helpers for the conversion CLI tests: run a script as a subprocess, make a tiny model."""
import os
import subprocess
import sys

from megatron_searchr1.models.tiny import TinyModelConfig, make_tiny_model
from tests.dist_utils import REPO

HF_TO_MEGATRON = REPO / "checkpoints_convert" / "hf_to_megatron.py"
MEGATRON_TO_HF = REPO / "checkpoints_convert" / "megatron_to_hf.py"


def run_cli(script, *args, timeout=300):
    """(returncode, combined output) of `python script args...` in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def tiny(path, arch="qwen2", tie=False, seed=0):
    return make_tiny_model(TinyModelConfig(output_dir=str(path), arch=arch, num_layers=2, num_heads=4,
                                           num_kv_heads=2, hidden_size=32, intermediate_size=64,
                                           tie_embeddings=tie, seed=seed))
