"""The configuration layer is a leaf: config/ imports nothing it configures, its torch-free records and rules
(finetune.py, layout.py) are what models/ and rollout/ apply, and their doctests hold."""
import ast
import doctest
import pathlib

import pytest

from megatron_searchr1 import config
from megatron_searchr1.config import ConfigError, finetune, layout, load_config, loader

CONFIG_DIR = pathlib.Path(config.__file__).parent


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a file imports, anywhere in it (also inside functions), as absolute names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            out.add("megatron_searchr1.config." + base if node.level else base)
    return out


SHARED_LEAVES = {"megatron_searchr1.field_docs", "megatron_searchr1.weight_files"}
"""Package-root modules config/ may import: stdlib-only helpers it shares with services outside the trainer."""


def test_config_imports_nothing_of_the_package_outside_config():
    for path in sorted(CONFIG_DIR.glob("*.py")):
        ours = {m for m in _imported_modules(path) if m.startswith("megatron_searchr1")}
        assert all(m.startswith("megatron_searchr1.config") or m in SHARED_LEAVES for m in ours), \
            (path.name, sorted(ours))


def test_the_shared_leaves_import_nothing_of_the_package():
    root = CONFIG_DIR.parent
    for name in SHARED_LEAVES:
        path = root / (name.split(".", 1)[1].replace(".", "/") + ".py")
        assert not {m for m in _imported_modules(path) if m.startswith("megatron_searchr1")}, name


@pytest.mark.parametrize("module", [finetune, layout, loader])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_models_map_exactly_the_lora_targets_the_config_accepts():
    from megatron_searchr1.models.lora_settings import HF_MODULE, PROJECTIONS

    # the order matters too: adapters are made (and seeded) in it, `projections` lists targets in it
    assert tuple(PROJECTIONS) == finetune.LORA_TARGETS
    assert tuple(HF_MODULE) == finetune.LORA_TARGETS


def test_the_model_code_applies_the_config_records():
    from megatron_searchr1.models import freeze
    from megatron_searchr1.rollout import engine_groups

    assert freeze.FreezeSettings is finetune.FreezeSettings
    assert engine_groups.LayoutError is layout.LayoutError
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.targets=[v_proj,q_proj]"])
    settings = cfg.model.lora.settings()
    assert type(settings) is finetune.LoraSettings
    assert (settings.rank, settings.alpha, settings.projections) == (4, 8.0, ("q_proj", "v_proj"))


def test_a_layout_no_engine_can_serve_is_a_config_error():
    cfg = load_config(None, ["parallel.tp=2", "parallel.pp=2", "rollout.engine_tp=4"])
    with pytest.raises(ConfigError, match=r"rollout.engine_tp=4 puts ranks \[0, 1, 2, 3\] in one vLLM engine"):
        cfg.validate(world_size=8, check_files=False)
    cfg = load_config(None, ["parallel.tp=2", "parallel.pp=2", "rollout.engine_tp=2"])
    cfg.validate(world_size=8, check_files=False)  # engines inside one tensor-parallel group: fine


def test_check_raises_the_message():
    loader.check(True, "unused")
    with pytest.raises(ConfigError, match="^data.batch_size must be >= 1$"):
        loader.check(False, "data.batch_size must be >= 1")
