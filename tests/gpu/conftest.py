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


@pytest.fixture(scope="session")
def copy_model(tmp_path_factory):
    """The copy model (`copy_model.py`), trained once per session: the GPU tests that compare outputs token for token
    share it."""
    from copy_model import train_copy_model

    return train_copy_model(tmp_path_factory.mktemp("copy-model"))

