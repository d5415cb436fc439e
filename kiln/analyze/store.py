"""Measured points as JSON lines, so an interrupted run resumes where it stopped.

The first line is the run's fingerprint (the model and the workload); each
later line is one measured point, or one configuration that could not be
served. A run with the same fingerprint reads them back and measures only
what is missing; a different fingerprint is refused (the points would not be
comparable). The SLOs are not in the fingerprint: the points stay valid when
only the objective changes. A line cut short by a crash is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.analyze.objective import Point
from kiln.analyze.space import Config, config_key
from kiln.errors import ConfigError

RESULTS_FILE = "results.jsonl"


class ResultStore:
    def __init__(self, directory: Path, fingerprint: dict[str, Any], resume: bool = True):
        self.path = Path(directory) / RESULTS_FILE
        self.fingerprint = fingerprint
        self.points: dict[tuple[str, float], Point] = {}
        self.invalid: dict[str, str] = {}
        self.resumed = 0
        if resume and self.path.is_file():
            self._read()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write_line({"kind": "fingerprint", "fingerprint": fingerprint}, mode="w")

    def _read(self) -> None:
        lines = self.path.read_text().splitlines()
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
        header = records[0] if records and records[0].get("kind") == "fingerprint" else None
        if header is None:
            raise ConfigError(f"{self.path} is not a kiln analyze results file; use another --output")
        stored = header.get("fingerprint", {})
        if stored != self.fingerprint:
            differ = sorted(k for k in set(stored) | set(self.fingerprint) if stored.get(k) != self.fingerprint.get(k))
            raise ConfigError(
                f"{self.path} holds results of another run (it differs in {', '.join(differ)}); "
                "use another --output, or --no-resume to start over"
            )
        for record in records[1:]:
            key = config_key(record["config"])
            if record.get("kind") == "point":
                self.points[(key, float(record["level"]))] = Point.from_json(record["point"])
            elif record.get("kind") == "invalid":
                self.invalid[key] = record["reason"]
        self.resumed = len(self.points)

    def _write_line(self, record: dict[str, Any], mode: str = "a") -> None:
        with open(self.path, mode) as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def get(self, config: Config, level: float) -> Point | None:
        return self.points.get((config_key(config), float(level)))

    def add(self, config: Config, point: Point) -> None:
        self.points[(config_key(config), float(point.level))] = point
        self._write_line({"kind": "point", "config": config, "level": point.level, "point": point.to_json()})

    def add_invalid(self, config: Config, reason: str) -> None:
        self.invalid[config_key(config)] = reason
        self._write_line({"kind": "invalid", "config": config, "reason": reason})
