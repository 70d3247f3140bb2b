"""Shared pytest set-up: the `slow` marker (skipped unless --runslow) and thread limits for 2-core machines."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long multi-process or end-to-end test (run with --runslow)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_outlives_its_module(request):
    """A test module that leaves a torch.distributed group or Megatron's parallel state alive is a bug (the next
    module's world-of-one set-up would join a stale world): its teardown errors, naming the module. Torch and Megatron
    are only inspected when the module loaded them, so light modules stay light."""
    def alive():
        import sys

        names = []
        if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
            names.append("a torch.distributed process group")
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None and ps.model_parallel_is_initialized():
            names.append("Megatron's parallel state")
        return names

    before = alive()
    yield
    after = alive()
    if after and not before:
        pytest.fail(f"{request.module.__name__} left {' and '.join(after)} alive: destroy it in the test or fixture "
                    "that made it (megatron_searchr1.megatron.initialize.destroy_megatron)", pytrace=False)
