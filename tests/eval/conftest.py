"""Eval tests run tiny models: one CPU thread each (see `one_thread`)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models spend their time in per-op overhead; extra threads only contend on a small CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
