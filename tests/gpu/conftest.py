"""GPU tests: marked `gpu` and skipped where CUDA is unavailable."""
import gc

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def copy_model(tmp_path_factory):
    """The copy model (`copy_model.py`), trained once per session: the GPU tests that compare outputs token for token
    share it."""
    from copy_model import train_copy_model

    return train_copy_model(tmp_path_factory.mktemp("copy-model"))


@pytest.fixture(scope="module", autouse=True)
def release_gpu_memory():
    """Each test module hands the memory its engines left in torch's cache back to the driver when it ends: a server
    that a later module starts sizes its KV cache from the device's free memory (as vLLM does)."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
