"""ParallelConfig validation, its CLI flags, and unsupported combinations."""
import re

import msgspec
import pytest

from kiln.cli.main import build_parser
from kiln.config import EngineConfig, ParallelConfig
from kiln.errors import ConfigError
from kiln.llm.parallel.plan import PlanChunk, StepPlan, WorkerInit, _decoder, _encoder


@pytest.mark.parametrize(
    "options",
    [
        dict(tensor_parallel_size=0),
        dict(pipeline_parallel_size=-1),
        dict(tensor_parallel_size=2.0),
        dict(tensor_parallel_size=True),
        dict(worker_launch="ssh"),
        dict(num_micro_batches=0),
        dict(dist_timeout_s=0),
        dict(dist_timeout_s=float("inf")),  # an OverflowError traceback when the group formed
        dict(dist_timeout_s=float("nan")),
    ],
)
def test_bad_parallel_options_raise(options):
    with pytest.raises(ConfigError):
        ParallelConfig(**options)


def test_from_flat_and_world_size():
    config = EngineConfig.from_flat(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert config.parallel.world_size == 6


def test_speculative_decoding_with_tp_is_rejected_at_start_up():
    with pytest.raises(ConfigError, match="speculative decoding is not supported with tensor or pipeline"):
        EngineConfig.from_flat(tensor_parallel_size=2, spec_method="ngram")


def test_cli_flags():
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 2)
    assert parser.parse_args(["worker"]).command == "worker"


def test_plans_round_trip_as_msgpack():
    plan = StepPlan([PlanChunk(0, [5, 6], 0, 2, [3], True)], [[0]])
    assert _decoder.decode(_encoder.encode(plan)) == plan
    init = WorkerInit(EngineConfig.from_flat(tensor_parallel_size=2), 10, 64)
    back = _decoder.decode(_encoder.encode(init))
    assert back.config == init.config and isinstance(back.config.parallel, ParallelConfig)
    with pytest.raises(msgspec.DecodeError):
        _decoder.decode(b"\x93\x01\x02\x03")


@pytest.mark.parametrize(("env", "flags", "message"), [
    ({"MASTER_ADDR": None}, {}, "set MASTER_ADDR"),
    ({"RANK": "abc"}, {}, "RANK must be a non-negative integer, got 'abc'"),  # a ValueError traceback
    ({"RANK": "5", "WORLD_SIZE": "2"}, {}, r"RANK must be in \[1, WORLD_SIZE\) = \[1, 2\), got 5"),  # waited 300 s
    ({"WORLD_SIZE": "0"}, {}, r"RANK must be in \[1, WORLD_SIZE\)"),  # ZeroDivisionError
    ({"RANK": "0"}, {}, "RANK 0 is the driver"),
    ({"MASTER_PORT": "99999"}, {}, r"MASTER_PORT must be in \[1, 65535\], got 99999"),
    ({}, {"timeout_s": float("nan")}, "--dist-timeout-s must be in"),
    ({}, {"timeout_s": 0.0}, "--dist-timeout-s must be in"),
    ({}, {"device": "tpu"}, "--device must be cpu or cuda"),
])
def test_a_worker_names_what_is_wrong_before_waiting_on_the_driver(env, flags, message):
    from kiln.llm.parallel.worker import setting_problem
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1"}
    environment = {k: v for k, v in {**base, **env}.items() if v is not None}
    problem = setting_problem(environment, flags.get("device", "cpu"), flags.get("timeout_s", 300.0))
    assert problem is not None and re.search(message, problem), problem
    assert setting_problem(base, "cpu", 300.0) is None
