"""Tests here run Kiln's Triton kernels under Triton's interpreter
(TRITON_INTERPRET=1) on CPU tensors.

The variable is set for each test's duration only: the kernels choose
between compiling and interpreting at launch (kiln.llm.kernels.triton_env),
so nothing leaks into other tests, whatever the order.
"""
import pytest


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
