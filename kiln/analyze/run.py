"""`kiln analyze`: search, measure, report, write the best configuration.

Exit status: 0 with a recommendation, 1 when no configuration met the
objective, 130 when interrupted (the report of what was measured is written
all the same, and running the same command again resumes).
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

from kiln.analyze import report
from kiln.analyze.config import AnalyzeConfig, parse_levels
from kiln.analyze.driver import Measurer
from kiln.analyze.load import Workload
from kiln.analyze.objective import Objective
from kiln.analyze.progress import Progress, StopFlag, describe_config
from kiln.analyze.search import SearchOutcome, choose_best, coordinate_search, optuna_search
from kiln.analyze.space import SearchSpace, parse_overrides
from kiln.analyze.store import ResultStore
from kiln.analyze.subject import LLMSubject, RepositorySubject, Subject
from kiln.errors import ConfigError


def make_subject(config: AnalyzeConfig, model: str | None, engine_options: dict[str, Any]) -> Subject:
    if config.model_repository is not None:
        if model is not None or engine_options:
            raise ConfigError("a repository model takes its options from its config.yaml: drop the model file and "
                              f"engine flags ({', '.join(sorted(engine_options)) or model})")
        assert config.model_name is not None  # AnalyzeConfig checks they come together
        return RepositorySubject(config.model_repository, config.model_name)
    return LLMSubject(model, engine_options)


def make_objective(config: AnalyzeConfig, kind: str) -> Objective:
    if kind != "llm" and (config.max_p99_ttft_ms is not None or config.max_p99_tpot_ms is not None):
        raise ConfigError("--max-p99-ttft-ms and --max-p99-tpot-ms apply to LLMs; use --max-p99-latency-ms")
    return Objective(kind, config.max_p99_latency_ms, config.max_p99_ttft_ms, config.max_p99_tpot_ms)


def make_workload(config: AnalyzeConfig, kind: str) -> Workload:
    if kind == "llm":
        return Workload("llm", parse_levels(config.request_rates, "request_rates"), config.level_duration_s,
                        input_len=config.input_len, output_len=config.output_len, seed=config.workload_seed)
    levels = parse_levels(config.concurrency, "concurrency", integers=True)
    return Workload("repository", levels, config.level_duration_s,
                    protocol=config.protocol, batch_size=config.batch_size, seed=config.workload_seed)


def make_output_dir(path: str) -> Path:
    """Create --output (and its parents). A path that is a file, or lies under one, is
    the user's to fix: a one-line ConfigError, not a FileExistsError traceback."""
    output = Path(path)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {path!r} exists and is not a directory", param="output")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, no permission, a read-only disk
        raise ConfigError(f"--output {path!r}: cannot create the directory ({exc.strerror or exc})",
                          param="output") from None
    return output


def planned_configs(space: SearchSpace, config: AnalyzeConfig) -> int:
    one_pass = 1 + sum(len(p.values) - 1 for p in space.params)
    planned = config.trials if config.search == "optuna" else one_pass
    return min(planned, config.max_configs) if config.max_configs else planned


def run_analyze(
    config: AnalyzeConfig, model: str | None, engine_options: dict[str, Any], param_specs: list[str],
    show_progress: bool = True, command: str = "",
) -> int:
    started = time.monotonic()
    subject = make_subject(config, model, engine_options)
    space = subject.space.restricted(parse_overrides(subject.space, param_specs))
    objective = make_objective(config, subject.kind)
    workload = make_workload(config, subject.kind)
    output = make_output_dir(config.output)
    store = ResultStore(output, {**subject.fingerprint(), "workload": workload.describe()}, config.resume)
    level_name = "request rate" if subject.kind == "llm" else "concurrency"
    stop, outcome = StopFlag(), SearchOutcome()
    progress = Progress(space.base, level_name, enabled=show_progress)
    stop.on_request.append(lambda: progress.console.print(
        "[bold]Ctrl-C: stopping after this load level, then writing the report (Ctrl-C again: at once)"))
    measurer = Measurer(subject, workload, objective, store, output / "work", stop, progress,
                        config.price_per_hour, config.fresh_server)
    interrupted = False
    try:
        with stop.installed(), progress:
            progress.plan(planned_configs(space, config) * len(workload.levels))
            if config.search == "optuna":
                optuna_search(space, measurer.evaluate, config.trials, config.workload_seed, config.min_gain,
                              config.max_configs, outcome)
            else:
                coordinate_search(space, measurer.evaluate, config.min_gain, config.max_passes,
                                  config.max_configs, outcome)
    except KeyboardInterrupt:
        interrupted = True
        outcome.stopped = "interrupted"
        outcome.best = choose_best(outcome, config.min_gain)
    finally:
        measurer.close()
    interrupted = interrupted or outcome.stopped == "interrupted"
    return finish(config, subject, space, objective, workload, outcome, store, started, interrupted, level_name,
                  command)


def finish(config: AnalyzeConfig, subject: Subject, space: SearchSpace, objective: Objective, workload: Workload,
           outcome: SearchOutcome, store: ResultStore, started: float, interrupted: bool, level_name: str,
           command: str) -> int:
    output = Path(config.output)
    files = []
    if outcome.best is not None and not interrupted:
        when = datetime.datetime.now().isoformat(timespec="seconds")
        changes = describe_config(outcome.best.config, space.base)
        header = (f"Written by kiln analyze ({when}): {objective.describe()}.\n"
                  f"Recommended: {changes}; {outcome.best.score:.1f} {objective.unit}. See report.md beside this.")
        files = subject.write(outcome.best.config, output, header)
    summary = report.RunSummary(
        model=subject.name, kind=subject.kind, space=space, objective=objective, workload=workload.describe(),
        level_name=level_name, search=_describe_search(config), outcome=outcome,
        elapsed_s=time.monotonic() - started, measured_now=len(store.points) - store.resumed,
        measured_before=store.resumed, price_per_hour=config.price_per_hour, files=files,
        command=command,
    )
    markdown, page = report.write(summary, output)
    print(f"report: {markdown} and {page}")
    for path in files:
        print(f"recommended configuration: {path}")
    if interrupted:
        print("interrupted: run the same command again to resume")
        return 130
    if outcome.best is None:
        print("no configuration met the objective (see the report)")
        return 1
    print(f"recommended: {describe_config(outcome.best.config, space.base)} "
          f"({outcome.best.score:.1f} {objective.unit}; base {outcome.base.score if outcome.base else 0:.1f})")
    return 0


def _describe_search(config: AnalyzeConfig) -> str:
    if config.search == "optuna":
        return f"optuna TPE, {config.trials} trials, seed {config.workload_seed}"
    return f"coordinate (line search per parameter, at most {config.max_passes} passes)"
