"""What the model tests share."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads, and lose a lot when the cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
