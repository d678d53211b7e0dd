import os

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors. The flag must be set
# before any kernel module is imported, which is why it lives here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernel tests run: CUDA when present, else CPU tensors through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
