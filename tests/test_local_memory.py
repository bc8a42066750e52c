"""Giving back the local memory that kernel autotuning leaves reserved (titan_gdn.ops.local_memory),
against a stand-in for the CUDA driver: the reset itself is checked on a GPU
(tests/gpu/test_delta_rule_op_gpu.py)."""

import contextlib
import ctypes
import logging

import pytest
import torch

from titan_gdn.ops import local_memory


class FakeDriver:
    """cuCtxGetLimit / cuCtxSetLimit on one context's stack limit."""

    def __init__(self, stack: int, set_status: int = 0):
        self.stack, self.set_status, self.sets = stack, set_status, []

    def cuCtxGetLimit(self, out, limit):
        assert limit == 0  # CU_LIMIT_STACK_SIZE
        ctypes.cast(out, ctypes.POINTER(ctypes.c_size_t)).contents.value = self.stack
        return 0

    def cuCtxSetLimit(self, limit, value):
        assert limit == 0
        self.sets.append(value.value)
        if self.set_status == 0:
            self.stack = value.value
        return self.set_status


def test_a_grown_stack_is_reset_to_the_default():
    driver = FakeDriver(stack=26128)
    assert local_memory.reset_stack_limit(driver) == 26128
    assert driver.sets == [1024] and driver.stack == 1024


@pytest.mark.parametrize("stack", [1024, 512])
def test_a_stack_at_or_below_the_default_is_left_alone(stack):
    driver = FakeDriver(stack=stack)
    assert local_memory.reset_stack_limit(driver) is None
    assert driver.sets == []


def test_a_failed_reset_warns_and_does_not_raise(caplog):
    driver = FakeDriver(stack=26128, set_status=2)  # CUDA_ERROR_OUT_OF_MEMORY
    with caplog.at_level(logging.WARNING):
        assert local_memory.reset_stack_limit(driver) is None
    assert "could not reset the CUDA stack limit from 26128" in caplog.text


def test_cpu_tensors_never_touch_the_driver(monkeypatch):
    monkeypatch.setattr(local_memory, "_cuda_driver", lambda: pytest.fail("driver loaded"))
    local_memory.release_after_first_use("op", torch.zeros(3))


def test_each_op_and_shape_is_checked_once(monkeypatch):
    """Only a first use can have autotuned: later calls must not read the limit (nor reset
    it again while the chosen kernels grow it to what they need)."""
    driver = FakeDriver(stack=26128)
    monkeypatch.setattr(local_memory, "_cuda_driver", lambda: driver)
    monkeypatch.setattr(local_memory, "_seen", set())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    x = torch.zeros(2, 3, device="meta")
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    local_memory.release_after_first_use("op", x)
    driver.stack = 4096  # the chosen kernel's own need, grown at its next launch
    local_memory.release_after_first_use("op", x)
    assert driver.sets == [1024] and driver.stack == 4096
    local_memory.release_after_first_use("op", torch.zeros(5, 3, device="meta"))  # new shape
    assert driver.sets == [1024, 1024]
    local_memory.release_after_first_use("other_op", x)  # nothing grew since
    assert driver.sets == [1024, 1024]
