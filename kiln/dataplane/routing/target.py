"""A route target: `model@version` (one version of a model) or `model` (its latest)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError
from kiln.serving.repository.config import check_model_name


@dataclass(frozen=True, order=True)
class Target:
    model: str
    version: int | None = None  # None: the highest loaded version

    @classmethod
    def parse(cls, text: str) -> Target:
        """'name' or 'name@N' (N a positive integer); ConfigError otherwise."""
        if not isinstance(text, str):
            raise ConfigError(f"a route target must be a string, got {text!r}")
        model, at, version = text.partition("@")
        try:
            check_model_name(model)
        except ConfigError:
            raise ConfigError(f"invalid route target {text!r}: expected 'model' or 'model@version'") from None
        if not at:
            return cls(model)
        if not (version.isascii() and version.isdigit()) or int(version) < 1:
            raise ConfigError(f"invalid route target {text!r}: the version after '@' must be a positive integer")
        return cls(model, int(version))

    @property
    def version_str(self) -> str:
        """The KServe version string: '' for the latest."""
        return "" if self.version is None else str(self.version)

    def __str__(self) -> str:
        return self.model if self.version is None else f"{self.model}@{self.version}"
