"""Triton, optional: whether it is importable, and kernels that follow TRITON_INTERPRET.

Kiln's GPU kernels are written in Triton so that Triton's interpreter can
run the same source on CPU tensors (`TRITON_INTERPRET=1`). `triton.jit`
decides between compiling and interpreting when it decorates a function, so
a kernel decorated at import would be fixed by whatever the environment held
then, and so would Triton's own library functions (`tl.sum`, `tl.max`,
`tl.cdiv`, ... are jitted when triton is imported). `kernel` defers the
choice to each launch: compiled, or interpreted with those library functions
swapped for interpreted copies while it runs. Tests set the variable for
their own duration (monkeypatch) and nothing leaks into other tests,
whatever the import order.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class Kernel:
    """A Triton kernel source, jitted per mode (compiled or interpreted) on first launch."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._jitted: dict[bool, Any] = {}

    def __getitem__(self, grid):
        mode = interpreting()
        jitted = self._jitted.get(mode)
        if jitted is None:
            import triton

            jitted = self._jitted[mode] = triton.jit(self.fn)
        if not mode:
            return jitted[grid]
        launch = jitted[grid]

        def interpreted(*args, **kwargs):
            with _interpretable_library():
                return launch(*args, **kwargs)

        return interpreted


@contextlib.contextmanager
def _interpretable_library():
    """While an interpreted kernel runs, Triton's jitted library functions
    (compiled-mode objects when triton was imported without TRITON_INTERPRET)
    are replaced by interpreted copies in triton.language and its modules."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    copies: dict[int, Any] = {}
    swapped = []
    for module in (tl, tl.standard, tl.math, tl.core):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                copy = copies.setdefault(id(value), _restoring_interpreted(value.fn))
                swapped.append((module, name, value))
                setattr(module, name, copy)
    try:
        yield
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


def _restoring_interpreted(fn: Callable[..., Any]):
    """An interpreted device function that undoes its patches of
    triton.language when it returns. Triton's own (3.9) patches the language
    for every device-function call and never restores it, which leaves the
    process unable to compile kernels for a GPU afterwards."""
    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError

    class Restoring(interpreter.InterpretedFunction):
        def __call__(self, *args, **kwargs):
            scope = interpreter._patch_lang(self.fn)
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as e:
                raise InterpreterError(repr(e)) from e
            finally:
                scope.restore()

    return Restoring(fn)


def kernel(fn: Callable[..., Any]) -> Kernel:
    return Kernel(fn)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
