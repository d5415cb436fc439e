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


def test_the_drivers_torchrun_environment_is_checked_before_it_waits():
    # No MASTER_ADDR was a 42-line torch traceback; WORLD_SIZE=3 for TP=2 was ignored until the timeout.
    from kiln.llm.parallel.executor import driver_env_problem

    good = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "0"}
    assert driver_env_problem(good, 2) is None
    assert driver_env_problem({k: v for k, v in good.items() if k not in ("WORLD_SIZE", "RANK")}, 2) is None
    cases = [
        ({**good, "MASTER_ADDR": ""}, "--worker-launch env needs MASTER_ADDR set"),
        ({k: v for k, v in good.items() if k != "MASTER_PORT"}, "needs MASTER_PORT set"),
        ({**good, "RANK": "1"}, "the driver must be RANK 0 (got RANK='1')"),
        ({**good, "WORLD_SIZE": "3"}, "WORLD_SIZE='3', but tensor_parallel_size x pipeline_parallel_size is 2"),
    ]
    for env, message in cases:
        assert message in (driver_env_problem(env, 2) or ""), (env, driver_env_problem(env, 2))
    with pytest.raises(ConfigError, match="worker_launch env joins other ranks"):
        ParallelConfig(worker_launch="env")
