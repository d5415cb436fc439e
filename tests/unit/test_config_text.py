import pytest
import yaml

from kiln.config_text import DuplicateKeyError, duplicate_json_key, load_yaml


def test_yaml_with_a_key_twice_is_an_error_naming_it_and_both_lines():
    with pytest.raises(DuplicateKeyError) as raised:
        load_yaml("routes:\n  r:\n    targets: {m@1: 1, m@2: 1}\n  r:\n    targets: {m@2: 1}\n")
    assert str(raised.value) == "line 4, column 3: found the key 'r' twice (first on line 2)"
    assert isinstance(raised.value, yaml.YAMLError)  # callers' YAML error handling reports it


def test_yaml_merge_keys_and_plain_documents_still_load():
    assert load_yaml("a: &x {k: 1, j: 2}\nb:\n  <<: *x\n  k: 3\n") == {"a": {"k": 1, "j": 2}, "b": {"k": 3, "j": 2}}
    assert load_yaml("backend: python\nparameters: {a: 1}\n") == {"backend": "python", "parameters": {"a": 1}}
    assert load_yaml("") is None


def test_json_duplicate_keys_found_at_any_depth():
    assert duplicate_json_key('{"a": 1, "b": {"x": 1, "y": 2, "x": 3}}') == "x"
    assert duplicate_json_key(b'[{"a": 1}, {"a": 2}]') is None  # different objects
    assert duplicate_json_key("{not json") is None
