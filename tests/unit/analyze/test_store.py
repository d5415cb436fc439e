"""The JSON-lines result store: what a resumed run reads back, and what it refuses."""

from __future__ import annotations

import pytest

from kiln.analyze.objective import Point
from kiln.analyze.store import RESULTS_FILE, ResultStore
from kiln.errors import ConfigError

FINGERPRINT = {"kind": "repository", "model": "/m", "workload": {"levels": [1.0, 4.0]}}


def test_points_and_unservable_configs_are_read_back(tmp_path):
    store = ResultStore(tmp_path, FINGERPRINT)
    store.add({"b": 8}, Point(level=1, requests=10, inferences_per_s=99.5))
    store.add_invalid({"b": 2}, "does not load")
    again = ResultStore(tmp_path, FINGERPRINT)
    assert again.resumed == 1
    assert again.get({"b": 8}, 1.0) == Point(level=1, requests=10, inferences_per_s=99.5)
    assert again.get({"b": 8}, 4.0) is None
    assert again.invalid == {'{"b": 2}': "does not load"}


def test_a_line_cut_short_is_ignored(tmp_path):
    store = ResultStore(tmp_path, FINGERPRINT)
    store.add({"b": 8}, Point(level=1, requests=10))
    with open(tmp_path / RESULTS_FILE, "a") as f:
        f.write('{"kind": "point", "config": {"b": 8}, "lev')
    assert ResultStore(tmp_path, FINGERPRINT).resumed == 1


def test_results_of_another_run_are_refused_unless_starting_over(tmp_path):
    ResultStore(tmp_path, FINGERPRINT).add({"b": 8}, Point(level=1, requests=10))
    other = {**FINGERPRINT, "workload": {"levels": [1.0, 2.0]}}
    with pytest.raises(ConfigError, match="another run \\(it differs in workload\\)"):
        ResultStore(tmp_path, other)
    fresh = ResultStore(tmp_path, other, resume=False)
    assert fresh.resumed == 0 and ResultStore(tmp_path, other).resumed == 0


def test_a_foreign_file_is_refused(tmp_path):
    (tmp_path / RESULTS_FILE).write_text('{"hello": 1}\n')
    with pytest.raises(ConfigError, match="not a kiln analyze results file"):
        ResultStore(tmp_path, FINGERPRINT)
