"""GPU tests: marked `gpu` and skipped where CUDA is unavailable."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


def pytest_configure(config):
    # several models of different shapes are compiled in one test process; a server compiles one
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64
