"""The `kiln` command: serve, generate, worker, repo validate, bench serve, bench infer, analyze.

Engine flags are derived from EngineConfig's dataclass fields (one flag per
field, `--block-size` for `block_size`) and server flags from ServerConfig,
each with the help and allowed values its field declares (kiln/config.py),
so a new config field is a new flag with no edit here. Only flags given on
the command line are passed on; the dataclasses own the defaults.

Each command imports its own modules inside its function, so `kiln --help`
and the light commands never load torch or the server stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from kiln.analyze.config import AnalyzeConfig
from kiln.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpecConfig,
    field_help,
    flat_options,
)
from kiln.deploy.ray_config import RayServeConfig
from kiln.errors import KilnError

ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, SpecConfig, ParallelConfig)
GROUP_TITLES = {
    ModelConfig: "model",
    CacheConfig: "KV cache",
    SchedulerConfig: "scheduler",
    SpecConfig: "speculative decoding",
    ParallelConfig: "tensor / pipeline parallelism",
    ServerConfig: "server",
    RayServeConfig: "Ray Serve replicas and autoscaling (with --ray)",
    AnalyzeConfig: "analyzer",
}


def _flag_type(hint: Any) -> type:
    """`int | None` -> int; bool, int, float, str as they are."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> list[str]:
    """One flag per field of `cls`; returns the field names added."""
    hints = typing.get_type_hints(cls)
    names = []
    group = parser.add_argument_group(GROUP_TITLES.get(cls, cls.__name__))
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), _flag_type(hints[f.name])
        text, choices = field_help(f)
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is not None:
            text += f" (default: {'on' if default is True else 'off' if default is False else default})"
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            values = [c for c in choices or () if c is not None]
            metavar = "{" + ",".join(map(str, values)) + "}" if values else kind.__name__.upper()
            group.add_argument(
                flag, dest=f.name, type=kind, default=None, choices=values or None, metavar=metavar, help=text
            )
        names.append(f.name)
    return names


def given(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def generate_options(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """`kiln generate`'s engine options: the flags given, and no KV pool
    warming unless asked: one prompt writes a few blocks, and `LLM` would
    fault the whole pool in before the first token."""
    return {"warm_kv_pool": False, **given(args, names)}


def add_engine_flags(parser: argparse.ArgumentParser) -> list[str]:
    parser.add_argument(
        "model", nargs="?", default=None, help="HF model directory or .gguf file (default: the installed SmolLM2 GGUF)"
    )
    names = []
    for section in ENGINE_SECTIONS:
        names += add_dataclass_flags(parser, section, skip=("model",))
    return names


# ---- serve -------------------------------------------------------------------


def run_serve(
    args: argparse.Namespace, engine_names: list[str], server_names: list[str], ray_names: list[str]
) -> int:
    from kiln.llm.engine.core_client import discard_prespawned, prespawn

    options = given(args, server_names)
    options.setdefault("api_key", os.environ.get("KILN_API_KEY") or None)
    config = ServerConfig(**options)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ray_options = given(args, ray_names)
    if ray_options and not args.ray:  # a flag mistake, said before anything is read
        raise KilnError(f"{', '.join('--' + n.replace('_', '-') for n in sorted(ray_options))} need --ray")
    from kiln.server.preflight import check_ray_address, check_ray_installed, check_server_config

    ray_config = RayServeConfig(**ray_options) if args.ray else None
    if ray_config is not None:
        check_ray_installed()
        check_ray_address(ray_config.ray_address)
    # Under Ray, Kiln's proxy binds the port only on the local cluster it starts itself.
    check_server_config(config, listens=not args.ray, http_only=args.ray and not ray_options.get("ray_address"))
    engine_options = given(args, engine_names)
    llm = None
    if args.model is not None or config.model_repository is None:
        llm = EngineConfig.from_flat(model=args.model, **engine_options)
        if not args.ray and config.engine_mode == "process":
            # The engine imports and loads while this process imports the server (torch, transformers:
            # ~4 of ~11 s to ready on 2 cores). Its config as the data plane will rebuild it, so it is adopted.
            prespawn(EngineConfig.from_flat(**flat_options(llm)))
        try:
            check_model(llm)
        except BaseException:
            discard_prespawned()
            raise
    elif engine_options:
        raise KilnError(
            f"engine flags ({', '.join(sorted(engine_options))}) apply to a command-line model; "
            "repository models take them from their config.yaml parameters"
        )
    if ray_config is not None:
        from kiln.deploy.ray_serve import run as run_on_ray

        return run_on_ray(config, llm, ray_config)
    from kiln.server.compose import build_dataplane
    from kiln.server.run import serve

    return serve(build_dataplane(config, llm))


def check_model(llm: EngineConfig) -> None:
    """A clear error (exit 2) for a device or model path the engine could not use, here
    rather than as a traceback from the engine process."""
    from kiln.llm.device import require_device
    from kiln.llm.models.loader import read_arch

    require_device(llm.model.device)
    if llm.model.model is not None:
        read_arch(llm.model.model)  # not a model, or of an unsupported family


def run_validate(repository: str) -> int:
    from kiln.dataplane.routing.spec import ROUTES_FILE
    from kiln.dataplane.routing.validate import validate_routes_file
    from kiln.serving.repository.validate import validate_repository

    problems = validate_repository(repository)
    if not any("is not a directory" in p for p in problems):
        problems += validate_routes_file(repository)
    for line in problems:
        print(line)
    if not problems:
        print(f"{repository}: all models valid")
        if (Path(repository) / ROUTES_FILE).is_file():
            print(f"{repository}: {ROUTES_FILE} valid")
    return 1 if problems else 0


# ---- generate ----------------------------------------------------------------


def run_generate(args: argparse.Namespace, engine_names: list[str]) -> int:
    from kiln.llm.llm import LLM
    from kiln.llm.sampling_params import SamplingParams

    # Checked before the engine is built: a bad --max-tokens fails in a moment, not after loading.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    llm = LLM(args.model, **generate_options(args, engine_names))
    with llm:  # stops parallel workers, if any
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            out = llm.generate(args.prompt, params)[0]
    completion = out.outputs[0]
    if completion.finish_reason == "error":
        raise KilnError(f"generation failed: {completion.error or 'the engine gave no reason'}")
    print(completion.text)
    return 0


# ---- analyze -------------------------------------------------------------------


def run_analyze(args: argparse.Namespace, engine_names: list[str], analyze_names: list[str],
                argv: list[str]) -> int:
    try:
        from kiln.analyze.run import run_analyze as analyze
    except ImportError as exc:  # matplotlib, optuna or rich missing
        raise KilnError(f"kiln analyze needs the 'analyze' extra: pip install 'kiln[analyze]' ({exc})") from None
    config = AnalyzeConfig(**given(args, analyze_names))
    return analyze(config, args.model, given(args, engine_names), args.param, command="kiln " + " ".join(argv))


# ---- the parser --------------------------------------------------------------


ANALYZE_EPILOG = """\
pruning: a load sweep stops at the first level that breaks an SLO or gains no
throughput; the coordinate search tries one parameter at a time from the best so
far (--max-passes), optuna samples --trials configurations (TPE).

writes into --output: results.jsonl (every point; Ctrl-C keeps it and the same
command resumes), report.md and report.html (table, cost per 1,000 predictions,
plots/*.png), and the best configuration: config.yaml (a repository model's,
or backend llm) and, for LLMs, serve-command.sh (kiln serve with its flags).

examples:
  kiln analyze --model-repository examples/tabular/repository --model-name breast_cancer \\
      --max-p99-latency-ms 20 --price-per-hour 0.5
  kiln analyze --max-p99-ttft-ms 2000 --max-p99-tpot-ms 200 --max-configs 6 \\
      --param max_num_seqs=8,32 --param max_num_batched_tokens=256,1024
"""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, list[str]]]:
    from kiln.bench.cli import add_bench_serve_arguments
    from kiln.bench.infer import add_bench_infer_arguments

    parser = argparse.ArgumentParser(prog="kiln", description="Kiln inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    names: dict[str, list[str]] = {}

    serve = sub.add_parser(
        "serve",
        help="serve a model (OpenAI + KServe v2 over HTTP) and/or a model repository (+ KServe v2 gRPC)",
    )
    names["engine"] = add_engine_flags(serve)
    names["server"] = add_dataclass_flags(serve, ServerConfig)
    serve.add_argument(
        "--ray", action="store_true",
        help="serve on Ray Serve: replicas of this server behind Ray's HTTP proxy on --host/--port, "
        "autoscaled between --ray-min-replicas and --ray-max-replicas (docs/scaling.md)",
    )
    names["ray"] = add_dataclass_flags(serve, RayServeConfig)

    gen = sub.add_parser("generate", help="one-shot offline generation")
    add_engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")

    worker = sub.add_parser(
        "worker",
        help="one tensor/pipeline-parallel rank (RANK >= 1) joining a driver started with --worker-launch env",
        description="Reads MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (torchrun-style); the model and "
        "every engine option come from the driver.",
    )
    worker.add_argument("--device", default="cpu", help="cpu or cuda (must match the driver's)")
    worker.add_argument("--dist-timeout-s", type=float, default=300.0)

    repo = sub.add_parser("repo", help="model repository tools")
    repo_sub = repo.add_subparsers(dest="repo_command", required=True)
    validate = repo_sub.add_parser("validate", help="check a model repository and print what is wrong")
    validate.add_argument("repository")

    analyze = sub.add_parser(
        "analyze",
        help="find the best serving configuration of a model under latency SLOs (report, plots, config file)",
        description="Starts real kiln serve configurations, drives them at increasing load with the bench "
        "load generators and searches the configurations that matter for the model (docs/operations.md, "
        "'kiln analyze'). An LLM: give its file and, optionally, engine flags (the base configuration). "
        "A repository model: --model-repository DIR --model-name NAME (the base is its config.yaml).",
        epilog=ANALYZE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names["analyze_engine"] = add_engine_flags(analyze)
    names["analyze"] = add_dataclass_flags(analyze, AnalyzeConfig)
    analyze.add_argument(
        "--param", action="append", default=[], metavar="NAME=V1,V2",
        help="search only the parameters given this way, over these values (repeatable); "
        "e.g. --param max_batch_size=16,64 --param max_queue_delay_ms=0,2",
    )

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_arguments(bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server"))
    add_bench_infer_arguments(bench_sub.add_parser("infer", help="concurrency sweep against a KServe v2 endpoint"))
    return parser, names


def main(argv: list[str] | None = None) -> int:
    parser, names = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return run_serve(args, names["engine"], names["server"], names["ray"])
        if args.command == "generate":
            return run_generate(args, names["engine"])
        if args.command == "worker":
            from kiln.llm.parallel.worker import main as worker_main

            return worker_main(["--device", args.device, "--dist-timeout-s", str(args.dist_timeout_s)])
        if args.command == "repo":
            return run_validate(args.repository)
        if args.command == "analyze":
            return run_analyze(args, names["analyze_engine"], names["analyze"], argv)
        if args.bench_command == "infer":
            from kiln.bench.infer import main_bench_infer

            return main_bench_infer(args)
        from kiln.bench.cli import run_bench_serve

        return run_bench_serve(args)
    except KilnError as e:
        print(f"kiln: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
