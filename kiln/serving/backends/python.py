"""Python backend: runs the user's class from `<version>/model.py`.

The class follows kiln.serving.model's contract (load/execute/unload; it
need not subclass Model). It is chosen by `parameters.class_name`, else it
is the one class defined in the file that has an `execute` method.
This runs the repository owner's code by design: only serve repositories
you trust, as with any Python plugin.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import itertools
import sys
from collections.abc import Iterator

from kiln.errors import ConfigError, describe
from kiln.serving.model import LoadContext, Model, Result
from kiln.serving.repository.loader import artifact_path
from kiln.serving.types import InferRequest

_counter = itertools.count()


def _load_module(path, model_name: str):
    module_name = f"kiln_user_model_{model_name.replace('.', '_').replace('-', '_')}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {path.name!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - sys.exit() at import is the model's failure too
        sys.modules.pop(module_name, None)
        raise ConfigError(f"{path.name!r} of model '{model_name}' failed to import: {describe(exc)}") from None
    return module


class ModelCodeExit(RuntimeError):
    """A user model's method raised a BaseException that is not an Exception."""


@contextlib.contextmanager
def user_code(model_name: str, method: str) -> Iterator[None]:
    """Run a user model's method. Its BaseExceptions (sys.exit(), an argparse failure,
    KeyboardInterrupt) become plain errors of that model: raised through the server's
    event loop, they would stop the whole process and every model in it."""
    try:
        yield
    except Exception:
        raise
    except BaseException as exc:  # noqa: BLE001 - see above
        raise ModelCodeExit(f"{method}() of model '{model_name}' raised {describe(exc)}") from None


def _find_class(module, class_name: str | None, model_name: str):
    if class_name:
        cls = getattr(module, class_name, None)
        if not inspect.isclass(cls):
            raise ConfigError(f"model.py of '{model_name}' has no class {class_name!r}")
        return cls
    candidates = [
        c for _, c in inspect.getmembers(module, inspect.isclass)
        if c.__module__ == module.__name__ and callable(getattr(c, "execute", None))
    ]
    if len(candidates) != 1:
        names = [c.__name__ for c in candidates]
        raise ConfigError(
            f"model.py of '{model_name}' must define exactly one class with execute() "
            f"(found {names}); or set parameters.class_name"
        )
    return candidates[0]


class PythonModel(Model):
    def load(self, context: LoadContext) -> None:
        config = context.config
        path = artifact_path(context.version_dir, config.artifact or "model.py")
        module = _load_module(path, config.name)
        class_name = config.parameters.get("class_name")
        cls = _find_class(module, None if class_name is None else str(class_name), config.name)
        self.module_name = module.__name__
        self.model_name = config.name
        try:
            with user_code(config.name, "__init__"):
                self.user = cls()
            if callable(getattr(self.user, "load", None)):
                with user_code(config.name, "load"):
                    self.user.load(context)
        except ConfigError:
            raise
        except ModelCodeExit as exc:
            raise ConfigError(str(exc)) from None
        except Exception as exc:
            raise ConfigError(f"load() of model '{config.name}' failed: {describe(exc)}") from None

    def execute(self, requests: list[InferRequest]) -> list[Result]:
        with user_code(self.model_name, "execute"):
            results = self.user.execute(requests)
        if not isinstance(results, (list, tuple)) or len(results) != len(requests):
            raise RuntimeError(
                f"execute() must return one result per request ({len(requests)}), "
                f"got {type(results).__name__}"
            )
        return list(results)

    def unload(self) -> None:
        try:
            if callable(getattr(self.user, "unload", None)):
                with user_code(self.model_name, "unload"):
                    self.user.unload()
        finally:
            sys.modules.pop(self.module_name, None)
