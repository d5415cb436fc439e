"""Operator configuration as text (config.yaml, routes.yaml, the admin API's
and the repository API's JSON documents), read strictly: a mapping naming one
key twice is an error. Plain YAML and JSON parsers keep the last value in
silence, so a duplicated route, target or setting would quietly override the
first (`targets: {m@1: 1, m@2: 1, m@1: 0}`)."""

from __future__ import annotations

import json
from typing import Any

import yaml


class DuplicateKeyError(yaml.constructor.ConstructorError):
    def __str__(self) -> str:  # one line, not PyYAML's excerpt of the document
        mark = self.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {self.problem}" if mark else str(self.problem)


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` keys, which explicit keys may override, are YAML's merge
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:
                continue  # an unhashable key: the base loader says so
            if first is not key_node:
                raise DuplicateKeyError(
                    "while constructing a mapping", node.start_mark,
                    f"found the key {key!r} twice (first on line {first.start_mark.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """The document in `text`; yaml.YAMLError (DuplicateKeyError for a key given twice) if it is not valid."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def duplicate_json_key(text: str | bytes) -> str | None:
    """The first key some object of a JSON document names twice, or None (invalid JSON: None;
    the caller's own parser reports it)."""
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if not found and len(set(keys)) < len(keys):
            found.append(next(k for i, k in enumerate(keys) if k in keys[:i]))
        return dict(items)

    try:
        json.loads(text, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    return found[0] if found else None
