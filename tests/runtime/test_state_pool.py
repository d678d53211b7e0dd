"""How much device memory the pool may take: the driver's free bytes and the caching allocator's
unused ones."""

import pytest
import torch

from mambastep.runtime import state_pool
from mambastep.runtime.state_pool import free_device_bytes


def test_free_bytes_count_what_the_allocator_holds_unused(monkeypatch):
    monkeypatch.setattr(state_pool.torch.cuda, "mem_get_info", lambda device: (10 << 30, 80 << 30))
    monkeypatch.setattr(state_pool.torch.cuda, "memory_reserved", lambda device: 60 << 30)
    monkeypatch.setattr(state_pool.torch.cuda, "memory_allocated", lambda device: 32 << 30)
    assert free_device_bytes(torch.device("cuda")) == (10 + 60 - 32) << 30


@pytest.mark.gpu
def test_freed_tensors_stay_free_to_the_pool():
    """A tensor freed goes back to the allocator, not the driver: the driver's count drops by it
    and stays down, the pool's does not (as after an FP8 model's load frees its bf16 weights)."""
    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    before = free_device_bytes(dev)
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    driver_with = torch.cuda.mem_get_info(dev)[0]
    assert abs(free_device_bytes(dev) - (before - (1 << 30))) < 64 << 20
    del x
    assert torch.cuda.mem_get_info(dev)[0] <= driver_with + (64 << 20)  # still the allocator's
    assert abs(free_device_bytes(dev) - before) < 64 << 20
