"""The engine process's body (`serve_engine`) on a config it cannot serve: it
reports Failed to the API process and logs the user's error without a
traceback (`kiln serve --device cuda` starts an engine ahead of its own check,
and that engine's log reaches the user's terminal)."""
import logging
from multiprocessing import Pipe

import msgspec
import pytest
import torch

from kiln.config import EngineConfig
from kiln.llm.engine.core_proc import serve_engine
from kiln.llm.engine.messages import Failed, from_engine_decoder


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")
def test_a_config_error_fails_the_engine_without_a_traceback(caplog):
    config_out, config_in = Pipe(duplex=False)
    result_out, result_in = Pipe(duplex=False)
    config_in.send_bytes(msgspec.msgpack.encode(EngineConfig.from_flat(device="cuda")))
    with caplog.at_level(logging.ERROR, logger="kiln.llm.engine.core_proc"):
        assert serve_engine(config_out, result_in) == 1
    failed = from_engine_decoder.decode(result_out.recv_bytes())
    assert isinstance(failed, Failed) and "device 'cuda' requested but" in failed.message
    records = [r for r in caplog.records if r.name == "kiln.llm.engine.core_proc"]
    assert records and all(r.exc_info is None for r in records)
    assert "device 'cuda' requested but" in records[0].getMessage()
