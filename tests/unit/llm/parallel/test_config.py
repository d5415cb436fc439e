"""ParallelConfig validation, its CLI flags, and unsupported combinations."""
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
