"""The control plane, locked down (issue 17): load/unload off unless asked for,
engine paths in a config confined to the model's version directory, errors
that do not reveal host paths; and one model's load failure (an `llm` too)
leaves the server and the other models serving."""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from starlette.testclient import TestClient

from kiln.config import ServerConfig
from kiln.dataplane.dataplane import DataPlane
from kiln.dataplane.llm_model import engine_options
from kiln.errors import ConfigError, ForbiddenError, KilnError, ModelLoadError, ModelNotFoundError
from kiln.server.app import build_app
from kiln.serving.types import InferRequest
from tests.unit.dataplane.planes import repository_plane
from tests.unit.serving.models import DOUBLER_PY, doubler_config, write_model

LLM_IO = {
    "inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]}],
    "outputs": [{"name": "text_output", "datatype": "BYTES", "dims": [1]}],
}


def llm_config(model: str) -> dict:
    return {"backend": "llm", **LLM_IO, "parameters": {"model": model, "kv_cache_memory_gib": 0.01}}


def test_model_control_is_off_by_default(tmp_path):
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})

    async def main():
        plane = DataPlane(ServerConfig(model_repository=str(tmp_path)))
        await plane.start()
        try:
            for call in (plane.load_model("doubler"), plane.unload_model("doubler")):
                with pytest.raises(ForbiddenError, match="--model-control explicit") as e:
                    await call
                assert e.value.http_status == 403 and e.value.grpc_code == "PERMISSION_DENIED"
            return plane.model_states()
        finally:
            await plane.shutdown()

    assert asyncio.run(main()) == {"doubler": "ready"}


@pytest.mark.parametrize("model", ["/etc", "../../elsewhere", "weights/../../x", ""])
def test_llm_paths_must_stay_in_the_version_directory(tmp_path, model):
    version = tmp_path / "llm" / "1"
    version.mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        engine_options({"model": model}, version)
    assert str(tmp_path) not in e.value.message and e.value.param == "model"


@pytest.mark.parametrize("template", ["/etc/passwd", "../../key.pem", "t/../../../x"])
def test_a_chat_template_file_must_stay_in_the_version_directory(tmp_path, template):
    # A config override's chat_template could name any host file (a TLS key): /tokenize and /detokenize
    # then read it back, and the load's error said whether the file existed.
    version = tmp_path / "llm" / "1"
    version.mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        engine_options({"chat_template": template}, version)
    assert e.value.param == "chat_template" and str(tmp_path) not in e.value.message
    (version / "chat.jinja").write_text("{{ messages }}")
    assert engine_options({"chat_template": "chat.jinja"}, version)["chat_template"] == str(
        (version / "chat.jinja").resolve())
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert engine_options({"chat_template": inline}, version)["chat_template"] == inline


def test_a_symlink_out_of_the_version_directory_is_refused(tmp_path):
    version = tmp_path / "repo" / "llm" / "1"
    version.mkdir(parents=True)
    os.symlink(tmp_path / "outside", version / "weights")
    with pytest.raises(ConfigError, match="leaves the version directory"):
        engine_options({"model": "weights", "draft_model": "weights"}, version)
    (version / "inside").mkdir()
    options = engine_options({"model": "inside", "dtype": "float32"}, version)
    assert options == {"model": str((version / "inside").resolve()), "dtype": "float32"}
    assert engine_options({"model": "/anywhere.gguf"}, None) == {"model": "/anywhere.gguf"}  # command line


def test_a_load_override_cannot_point_an_llm_at_the_host(tmp_path):
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    outside = tmp_path.parent / "secret.gguf"

    async def main():
        plane = repository_plane(tmp_path, engine_mode="thread")
        await plane.start()
        try:
            messages = []
            for model in (str(outside), "../../secret.gguf", "missing.gguf"):
                with pytest.raises(ModelLoadError) as e:
                    await plane.load_model("doubler", {"config": llm_config(model)})
                messages.append(e.value.message)
                assert e.value.http_status == 400, e.value  # the request's mistake (missing.gguf was a 500)
            return messages, plane.model_states()
        finally:
            await plane.shutdown()

    messages, states = asyncio.run(main())
    assert "must be a relative path" in messages[0] and "must be a relative path" in messages[1]
    for message in messages:  # the first echoes the client's own path; none names the repository's
        assert str(tmp_path) not in message, message
    assert "<repository>/doubler/1/missing.gguf" in messages[2]
    assert states == {"doubler": "ready"}  # the failed reloads left version 1 serving


def test_one_llm_failing_to_load_leaves_the_server_and_the_others_serving(tmp_path):
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    write_model(tmp_path, "broken_llm", llm_config("missing.gguf"), {1: {"README": "no weights here"}})
    plane = DataPlane(ServerConfig(model_repository=str(tmp_path), engine_mode="thread"))
    fatal: list[str] = []
    with TestClient(build_app(plane, on_fatal=fatal.append)) as client:
        for _ in range(600):
            states = client.get("/health").json()["models"]
            if "loading" not in states.values():
                break
            asyncio.run(asyncio.sleep(0.05))
        assert states == {"doubler": "ready", "broken_llm": "unavailable"}
        assert client.get("/v2/health/live").status_code == 200
        r = client.post("/v2/models/doubler/infer",
                        json={"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]})
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2.0, 4.0]
        index = {row["name"]: row for row in client.post("/v2/repository/index", json={}).json()}
        assert index["broken_llm"]["state"] == "UNAVAILABLE" and str(tmp_path) not in index["broken_llm"]["reason"]
    assert fatal == []


def test_hostile_loads_over_http_and_grpc_are_400_and_inference_goes_on(tmp_path):
    """With --model-control explicit, a load whose override points an `llm` at the
    host is refused over both transports (400 / INVALID_ARGUMENT naming the rule,
    no repository path), while requests in flight beside them are answered."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    from tests.integration.openai.live import free_port

    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    port = free_port()
    plane = repository_plane(tmp_path, grpc_port=port, engine_mode="thread")
    hostile = json.dumps(llm_config("/etc/passwd"))
    good = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    with TestClient(build_app(plane)) as client:
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")

        def http_load():
            return client.post("/v2/repository/models/doubler/load", json={"parameters": {"config": hostile}})

        def grpc_load():
            with pytest.raises(InferenceServerException) as e:
                grpc.load_model("doubler", config=json.dumps(llm_config("../../secret.gguf")))
            return e.value

        with ThreadPoolExecutor(6) as pool:
            loads = [pool.submit(http_load), pool.submit(grpc_load)]
            infers = [pool.submit(client.post, "/v2/models/doubler/infer", json=good) for _ in range(4)]
            r, refused = loads[0].result(), loads[1].result()
            answers = [f.result() for f in infers]
        assert r.status_code == 400 and "must be a relative path" in r.json()["error"], r.text
        assert "INVALID_ARGUMENT" in str(refused.status()) and "must be a relative path" in refused.message()
        for message in (r.text, refused.message()):
            assert str(tmp_path) not in message
        assert [a.json()["outputs"][0]["data"] for a in answers] == [[2.0, 4.0]] * 4
        assert grpc.is_model_ready("doubler")
        grpc.close()


def test_load_errors_name_the_model_not_the_path_and_leave_no_model_loading(tmp_path, monkeypatch):
    # A repository given as "." (or "repo"): a message's "model.py" or "repository"
    # stays as written; a model whose directory went is a 404 on reload; a model
    # module that raises SystemExit fails its load instead of staying LOADING.
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    write_model(tmp_path, "quits", doubler_config(), {1: {"model.py": "raise SystemExit(3)\n"}})
    write_model(tmp_path, "lacks", doubler_config(artifact="helper.py"), {1: {"model.py": DOUBLER_PY}})

    async def main():
        plane = repository_plane(tmp_path.relative_to(tmp_path))  # "."
        await plane.start()
        try:
            await plane.load_model("doubler")
            with pytest.raises(ModelLoadError) as quit_error:
                await plane.load_model("quits")
            with pytest.raises(ModelLoadError) as lack_error:
                await plane.load_model("lacks")
            for path in (tmp_path / "doubler" / "1" / "model.py", tmp_path / "doubler" / "config.yaml"):
                path.unlink()
            (tmp_path / "doubler" / "1").rmdir()
            (tmp_path / "doubler").rmdir()
            with pytest.raises(ModelNotFoundError, match="'doubler' is not in the model repository$"):
                await plane.load_model("doubler")
            return quit_error.value.message, lack_error.value.message, plane.model_states()
        finally:
            await plane.shutdown()

    quit_message, lack_message, states = asyncio.run(main())
    assert quit_message == "failed to load 'quits': 'model.py' of model 'quits' failed to import: SystemExit: 3"
    assert lack_message == "failed to load 'lacks': artifact 'helper.py' not found in version directory '1'"
    assert states["quits"] == "unavailable" and states["doubler"] == "ready"  # version 1 still serves


def test_a_model_that_exits_or_interrupts_in_load_or_unload_fails_alone(tmp_path):
    # KeyboardInterrupt from a model's load() stopped `kiln serve` (exit 130); sys.exit() in its
    # unload() stopped a running server with every model in it.
    interrupts = DOUBLER_PY + "\n    def __init__(self):\n        raise KeyboardInterrupt\n"
    exits = DOUBLER_PY + "\n    def unload(self):\n        raise SystemExit(4)\n"
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    write_model(tmp_path, "interrupts", doubler_config(), {1: {"model.py": interrupts}})
    write_model(tmp_path, "exits", doubler_config(), {1: {"model.py": exits}})

    async def main():
        plane = repository_plane(tmp_path)
        await plane.start()
        try:
            await plane.load_model("doubler")
            with pytest.raises(ModelLoadError) as interrupted:
                await plane.load_model("interrupts")
            await plane.load_model("exits")
            await plane.unload_model("exits")
            request = InferRequest("doubler", {"IN": np.ones((1, 4), np.float32)})
            assert (await plane.infer(request)).outputs["OUT"].tolist() == [[2.0] * 4]  # the server goes on
            return interrupted.value.message, plane.model_states()
        finally:
            await plane.shutdown()

    message, states = asyncio.run(main())
    assert message == "failed to load 'interrupts': __init__() of model 'interrupts' raised KeyboardInterrupt"
    assert states["doubler"] == "ready" and states["interrupts"] == "unavailable" and "exits" not in states


MISSHAPEN_PY = """
import numpy as np

class Misshapen:
    def execute(self, requests):
        out = []
        for r in requests:
            x = r.inputs["IN"]
            kind = int(x.flat[0])
            value = {1: x.reshape(*x.shape, 1),                    # a rank the config does not declare
                     2: np.zeros((5, x.shape[1]), np.float32),     # 5 rows for a request of 2
                     3: np.full(x.shape, np.nan)}.get(kind, x * 2)  # NaN for an INT32 output
            text = [[5] * x.shape[1]] * x.shape[0] if kind == 4 else [["a"] * x.shape[1]] * x.shape[0]
            out.append({"OUT": value, "TEXT": np.array(text, dtype=object)})
        return out
"""


def test_outputs_that_break_their_declaration_are_errors_naming_them(tmp_path):
    # Each was a 200: a rank-3 output for dims [-1], 5 rows answering 2, NaN as INT32 -2147483648,
    # and the number 5 as BYTES turned into five zero bytes.
    config = doubler_config(outputs=[{"name": "OUT", "datatype": "INT32", "dims": [-1]},
                                     {"name": "TEXT", "datatype": "BYTES", "dims": [-1]}])
    write_model(tmp_path, "misshapen", config, {1: {"model.py": MISSHAPEN_PY}})

    async def main():
        plane = repository_plane(tmp_path)
        await plane.start()
        outcomes = []
        try:
            await plane.load_model("misshapen")
            for kind in (1, 2, 3, 4, 6):
                request = InferRequest("misshapen", {"IN": np.full((2, 3), kind, np.float32)})
                try:
                    response = await plane.infer(request)
                    outcomes.append((response.outputs["OUT"].tolist(), response.outputs["TEXT"].tolist()))
                except KilnError as exc:
                    outcomes.append(exc.message)
        finally:
            await plane.shutdown()
        return outcomes

    rank, rows, nan, number, fine = asyncio.run(main())
    prefix = "model 'misshapen' returned output"
    assert rank == f"{prefix} 'OUT' of shape [2, 3, 1]; its config declares [2, -1] (the first: the request's batch)"
    assert rows == f"{prefix} 'OUT' of shape [5, 3]; its config declares [2, -1] (the first: the request's batch)"
    assert nan == f"{prefix} 'OUT' with NaN or infinite values, which INT32 cannot hold"
    assert number == f"{prefix} 'TEXT' that is not all str or bytes: a BYTES element must be str or bytes, got int"
    assert fine == ([[12] * 3] * 2, [[b"a"] * 3] * 2)


def test_a_config_override_naming_a_key_twice_or_not_json_is_refused_by_name(tmp_path):
    # As in config.yaml: the last value won in silence.
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})

    async def main():
        plane = repository_plane(tmp_path)
        await plane.start()
        try:
            with pytest.raises(KilnError, match=r"the 'config' load parameter is not valid JSON: "):
                await plane.load_model("doubler", {"config": '{"backend": "python",'})
            with pytest.raises(KilnError, match="names the key 'max_batch_size' twice") as e:
                await plane.load_model("doubler", {"config": '{"backend": "python", "max_batch_size": 4, '
                                                             '"max_batch_size": 0}'})
            return e.value.http_status
        finally:
            await plane.shutdown()

    assert asyncio.run(main()) == 400


def test_the_repository_index_says_a_version_whose_engine_died_is_unavailable(tmp_path):
    # It said READY (HTTP and gRPC) while /health said "dead" and every request was a 503.
    from kiln.serving.model import AsyncModel

    class DeadEngine(AsyncModel):
        def healthy(self):
            return False

        def health_problem(self):
            return "engine dead"

    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})

    async def main():
        plane = repository_plane(tmp_path)
        await plane.start()
        try:
            healthy = plane.repository_index()
            plane.models.entry("doubler").versions[1].async_model = DeadEngine()
            return healthy, plane.repository_index(), plane.repository_index(ready_only=True)
        finally:
            plane.models.entry("doubler").versions[1].async_model = None
            await plane.shutdown()

    healthy, dead, ready = asyncio.run(main())
    assert healthy == [{"name": "doubler", "version": "1", "state": "READY", "reason": ""}]
    assert dead == [{"name": "doubler", "version": "1", "state": "UNAVAILABLE", "reason": "engine dead"}]
    assert ready == []


def test_an_engine_process_that_cannot_load_the_model_is_a_400_load_error(tmp_path):
    # Across the process boundary the engine's ModelLoadError became "engine failed to start", a 500.
    write_model(tmp_path, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY, "bad.gguf": "not a GGUF file"}})

    async def main():
        plane = repository_plane(tmp_path, engine_mode="process")
        await plane.start()
        try:
            with pytest.raises(ModelLoadError) as e:
                await plane.load_model("doubler", {"config": llm_config("bad.gguf")})
            return e.value
        finally:
            await plane.shutdown()

    error = asyncio.run(main())
    assert error.http_status == 400 and "engine failed to start: ModelLoadError" in error.message, error.message
