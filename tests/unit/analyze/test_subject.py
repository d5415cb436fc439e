"""Subjects: how a configuration is served and written out."""

from __future__ import annotations

import os

import yaml

from kiln.analyze.subject import LLMSubject, RepositorySubject
from kiln.config import EngineConfig
from kiln.serving.repository.config import parse_config

CONFIG = """backend: onnxruntime
max_batch_size: 64
dynamic_batching: {max_queue_delay_ms: 2, preferred_batch_sizes: [16, 32]}
"""


def _repo(tmp_path):
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "config.yaml").write_text(CONFIG)
    (model / "1" / "model.onnx").write_bytes(b"weights")
    return tmp_path / "repo"


def test_a_served_configuration_never_touches_the_users_repository(tmp_path):
    subject = RepositorySubject(_repo(tmp_path), "m")
    config = {**subject.space.base, "max_batch_size": 128}
    args = subject.serve_args(config, tmp_path / "work")
    served = tmp_path / "work" / "repository" / "m"
    assert args == ["--model-repository", str(tmp_path / "work" / "repository")]
    assert yaml.safe_load((served / "config.yaml").read_text())["max_batch_size"] == 128
    assert (tmp_path / "repo" / "m" / "config.yaml").read_text() == CONFIG  # a hard link is not written through
    assert (served / "1" / "model.onnx").read_bytes() == b"weights"
    subject.serve_args({**config, "max_batch_size": 32}, tmp_path / "work")  # a second start rewrites it
    assert yaml.safe_load((served / "config.yaml").read_text())["max_batch_size"] == 32
    assert (tmp_path / "repo" / "m" / "config.yaml").read_text() == CONFIG


def test_the_recommended_repository_config_is_ready_to_use(tmp_path):
    subject = RepositorySubject(_repo(tmp_path), "m")
    [path] = subject.write({**subject.space.base, "max_queue_delay_ms": 0.0}, tmp_path, "line one\nline two")
    text = path.read_text()
    assert text.startswith("# line one\n# line two\n")
    config = parse_config(yaml.safe_load(text), name="m")
    assert config.dynamic_batching.max_queue_delay_ms == 0 and config.dynamic_batching.preferred_batch_sizes == (16, 32)
    assert subject.problem({**subject.space.base, "max_batch_size": 8}) is not None  # [16, 32] > 8


def test_llm_flags_and_files(tmp_path):
    subject = LLMSubject("/models/smol.gguf", {"max_num_seqs": 32})
    config = {**subject.space.base, "enable_chunked_prefill": False, "quantization": "int8"}
    assert subject.name == "smol"
    assert subject.serve_args(config, tmp_path) == [
        "/models/smol.gguf", "--quantization", "int8", "--max-num-seqs", "32", "--no-enable-chunked-prefill",
        "--served-model-name", "smol"]
    assert subject.load_config(config) == {"backend": "llm", "parameters": {
        "model": "/models/smol.gguf", "quantization": "int8", "max_num_seqs": 32, "enable_chunked_prefill": False}}
    script, repo_config = subject.write(config, tmp_path, "hello")
    assert os.access(script, os.X_OK)
    assert script.read_text().splitlines()[-1] == (
        "exec kiln serve /models/smol.gguf --quantization int8 --max-num-seqs 32 --no-enable-chunked-prefill "
        '--served-model-name smol "$@"')
    parameters = yaml.safe_load(repo_config.read_text())["parameters"]
    assert EngineConfig.from_flat(**parameters).scheduler.enable_chunked_prefill is False
