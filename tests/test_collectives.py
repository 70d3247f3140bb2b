"""Every tensor collective in the package, and where its tensor lives.

On GPUs the default process group is `cpu:gloo,cuda:nccl` (megatron/initialize.py), but a group made with an
explicit NCCL backend refuses CPU tensors, so the rule is: a collective's tensor is on `collective_device()` (the
current GPU, or the CPU without one) or is a model tensor (on that device already). The list below names each call
site with the reason it follows the rule; a new call site fails `test_every_collective_call_site_is_listed` until
it is placed and listed. `*_object` collectives pick their own device and are not listed.
"""
import ast
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_searchr1"
TENSOR_COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                      "reduce_scatter_tensor", "reduce", "all_to_all", "all_to_all_single", "scatter", "gather",
                      "send", "recv", "isend", "irecv", "batch_isend_irecv"}

# (file, enclosing function, collective) -> why its tensor is on the collective device
PLACED = {
    ("metrics.py", "mean_over_ranks", "all_reduce"): "packed with device=collective_device()",
    ("trainer/losses.py", "dp_sum.reduce", "all_reduce"): "copied to collective_device() and back",
    ("trainer/losses.py", "any_rank", "all_reduce"): "made with device=collective_device()",
    ("trainer/sft.py", "SFTTrainer.validate", "all_reduce"): "validation totals moved to collective_device()",
    ("megatron/vocab_parallel.py", "_all_reduce", "all_reduce"): "softmax statistics of the logits (model output)",
    ("models/convert.py", "gather_hf_weights", "all_gather"): "TP shards of model parameters (empty_like them)",
    ("models/convert.py", "_gather_experts", "all_gather"): "EP shards of expert parameters (empty_like them)",
    ("megatron/moe_metrics.py", "moe_step_metrics", "all_reduce"): "token counts moved to collective_device()",
    ("models/lora.py", "LoraAdapter.gather", "all_gather"):
        "adapter parameters / their grads, and buffers made with device=b.device (the adapter's)",
    ("rollout/weight_sync.py", "WeightSync._gather_and_map", "all_gather_into_tensor"):
        "packed model parameters; the receive buffer is made on the same device",
    ("rollout/weight_sync.py", "sync_expert_weights", "broadcast"):
        "expert parameters on the source stage, torch.empty(device=collective_device()) on the others",
    ("rollout/weight_sync.py", "WeightSync._by_broadcast", "broadcast"):
        "packed model parameters on the source stage, self._device() on the others",
    ("megatron/schedule.py", "_broadcast_from_last_stage", "broadcast"):
        "model outputs on the last stage, torch.empty(device=collective_device()) on the others",
    ("megatron/schedule.py", "_set_global_counts", "all_reduce"): "made with device=collective_device()",
    ("megatron/schedule.py", "forward_backward", "all_reduce"): "made with device=collective_device()",
    ("megatron/schedule.py", "equal_micro_batch_count", "all_reduce"): "made with device=collective_device()",
}


def _call_sites(root: Path = PACKAGE) -> set[tuple[str, str, str]]:
    """(file relative to the package, Class.function or outer.inner, collective) for each `dist.X(...)` /
    `torch.distributed.X(...)` call with X a tensor collective."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))

        def visit(node, scope):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, scope + [child.name])
                    continue
                if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                        and child.func.attr in TENSOR_COLLECTIVES and _is_dist(child.func.value):
                    found.add((path.relative_to(root).as_posix(), ".".join(scope), child.func.attr))
                visit(child, scope)

        visit(tree, [])
    return found


def _is_dist(node) -> bool:
    """`dist` or `torch.distributed` (the ways the package names torch.distributed)."""
    if isinstance(node, ast.Name):
        return node.id == "dist"
    return isinstance(node, ast.Attribute) and node.attr == "distributed"


def test_every_collective_call_site_is_listed():
    found = _call_sites()
    assert found - set(PLACED) == set(), (
        "new tensor collective(s): put the tensor on megatron.initialize.collective_device() (or use a model "
        "tensor) and add the call site to PLACED with the reason")
    assert set(PLACED) - found == set(), "PLACED lists call sites that no longer exist: remove them"


def test_the_scan_finds_a_cpu_tensor_collective(tmp_path):
    """The scanner itself: a module with a collective on a CPU tensor is found (so the listing above can fail)."""
    (tmp_path / "new.py").write_text("import torch.distributed as dist\nimport torch\n"
                                     "def f():\n    dist.all_reduce(torch.zeros(1))\n"
                                     "    torch.distributed.broadcast(torch.zeros(1), src=0)\n")
    assert _call_sites(tmp_path) == {("new.py", "f", "all_reduce"), ("new.py", "f", "broadcast")}


def test_mean_over_ranks_packs_its_tensor_on_the_collective_device(monkeypatch):
    """metrics.mean_over_ranks (every step, the adaptive KL, SFT) hands all_reduce a tensor on
    collective_device(): the CUDA device on GPUs, where the old CPU float64 tensor made NCCL raise. The patched
    device is `meta`, which no tensor lands on by accident; the patched all_reduce records the device and stops
    the call there (a meta tensor has no values to read back)."""
    import torch.distributed as dist

    from megatron_searchr1 import collectives, metrics

    class _Reduced(Exception):
        pass

    seen = []

    def all_reduce(t, group=None):
        seen.append(t.device)
        raise _Reduced

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * 2))
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(collectives, "collective_device", lambda: torch.device("meta"))
    with pytest.raises(_Reduced):
        metrics.mean_over_ranks({"b": 1.0, "a": 3.0})
    assert seen == [torch.device("meta")]


@pytest.mark.parametrize("cuda", [False, True])
def test_collective_device_is_the_current_gpu_when_there_is_one(monkeypatch, cuda):
    from megatron_searchr1.collectives import collective_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert collective_device() == (torch.device("cuda", 5) if cuda else torch.device("cpu"))
