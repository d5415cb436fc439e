"""The `kiln` command line: one flag per config field, only given flags passed on."""

from __future__ import annotations

import dataclasses

from kiln.cli.main import ENGINE_SECTIONS, build_parser, generate_options, given
from kiln.config import EngineConfig, ServerConfig


def test_every_engine_and_server_field_is_a_flag():
    parser, names = build_parser()
    engine_fields = {f.name for c in ENGINE_SECTIONS for f in dataclasses.fields(c)} - {"model"}
    assert set(names["engine"]) == engine_fields
    assert set(names["server"]) == {f.name for f in dataclasses.fields(ServerConfig)}


def test_serve_flags_build_config_and_settings():
    parser, names = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "/models/m.gguf",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--kv-cache-memory-gib",
            "0.5",
            "--port",
            "9000",
            "--max-queued-requests",
            "4",
        ]
    )
    config = EngineConfig.from_flat(model=args.model, **given(args, names["engine"]))
    assert config.model.model == "/models/m.gguf"
    assert (config.cache.block_size, config.cache.enable_prefix_caching, config.cache.kv_cache_memory_gib) == (
        32,
        False,
        0.5,
    )
    assert config.scheduler == EngineConfig().scheduler  # untouched sections keep their defaults
    settings = ServerConfig(**given(args, names["server"]))
    assert (settings.port, settings.max_queued_requests, settings.host) == (9000, 4, "127.0.0.1")


def test_generate_and_bench_parse():
    parser, _ = build_parser()
    args = parser.parse_args(["generate", "--prompt", "Hi", "--chat", "--max-tokens", "5"])
    assert (args.prompt, args.chat, args.max_tokens, args.model) == ("Hi", True, 5, None)
    # generate faults its KV pool in only when asked (the offline LLM does by default).
    parser, names = build_parser()
    args = parser.parse_args(["generate", "--prompt", "Hi"])
    assert generate_options(args, names["engine"]) == {"warm_kv_pool": False}
    args = parser.parse_args(["generate", "--prompt", "Hi", "--max-num-batched-tokens", "64", "--block-size", "32",
                              "--warm-kv-pool"])
    assert generate_options(args, names["engine"]) == {
        "max_num_batched_tokens": 64, "block_size": 32, "warm_kv_pool": True
    }
    args = parser.parse_args(["bench", "serve", "--model", "m", "--request-rate", "2", "--goodput", "ttft:500"])
    assert (args.model, args.request_rate, args.goodput) == ("m", 2.0, ["ttft:500"])


def test_ray_flags_are_derived_and_need_ray(capsys):
    from kiln.cli.main import main
    from kiln.deploy.ray_config import RayServeConfig

    parser, names = build_parser()
    assert set(names["ray"]) == {f.name for f in dataclasses.fields(RayServeConfig)}
    args = parser.parse_args(["serve", "--ray", "--ray-max-replicas", "6", "--ray-autoscaling-policy", "kiln-hint"])
    assert args.ray and RayServeConfig(**given(args, names["ray"])).ray_max_replicas == 6
    # Ray options without --ray are a mistake, said before any model loads.
    assert main(["serve", "/nonexistent.gguf", "--ray-max-replicas", "6"]) == 2
    assert "--ray-max-replicas need --ray" in capsys.readouterr().err


def test_serve_settings_it_cannot_use_are_one_line_errors(tmp_path, capsys):
    # Each was a server that stayed unready forever (the repository) or a traceback
    # from uvicorn's or gRPC's start (TLS files, the address), or torch's (the device).
    import socket

    from kiln.cli.main import main

    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("not a certificate\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        cases = [
            (["--model-repository", str(tmp_path / "missing")], "model_repository '"),
            (["--model-repository", str(not_pem)], "is not a directory"),
            (["--model-repository", str(tmp_path), "--ssl-certfile", str(tmp_path / "nope.pem"), "--ssl-keyfile",
              str(not_pem)], "ssl_certfile '"),
            (["--model-repository", str(tmp_path), "--ssl-certfile", str(tmp_path), "--ssl-keyfile", str(not_pem)],
             "is not a file"),
            (["--model-repository", str(tmp_path), "--ssl-certfile", str(not_pem), "--ssl-keyfile", str(not_pem)],
             "are not a PEM certificate and its unencrypted private key"),
            (["--model-repository", str(tmp_path), "--port", busy], f"cannot listen on 127.0.0.1:{busy} (port)"),
            (["--model-repository", str(tmp_path), "--port", "0", "--grpc-port", busy], "(grpc_port)"),
            (["--model-repository", str(tmp_path), "--host", "999.1.1.1", "--port", "0", "--grpc-port", "0"],
             "cannot listen on 999.1.1.1:"),
            # Loaded every model first, then failed in uvicorn with exit code 3.
            (["--model-repository", str(tmp_path), "--port", "18999", "--grpc-port", "18999"],
             "port and grpc_port are both 18999; HTTP and gRPC need a port each"),
        ]
        for flags, message in cases:
            assert main(["serve", *flags]) == 2, flags
            err = capsys.readouterr().err
            assert err.startswith("kiln: error: ") and message in err and "Traceback" not in err, (flags, err)
    assert main(["generate", "--device", "cuda:abc", "--prompt", "hi"]) == 2
    assert "device 'cuda:abc' is not a device name" in capsys.readouterr().err


def test_generate_exits_non_zero_when_its_request_fails(tiny_llama_dir, capsys, monkeypatch):
    # It printed an empty line and exited 0.
    from kiln.cli.main import main
    from kiln.llm.llm import LLM
    from kiln.llm.outputs import CompletionOutput, RequestOutput

    failed = CompletionOutput(0, "", [], finish_reason="error", error="RuntimeError: the kernel failed")
    monkeypatch.setattr(LLM, "generate", lambda self, *a, **k: [RequestOutput("r", "Hi", [1], [failed], True)])
    rc = main(["generate", str(tiny_llama_dir), "--prompt", "Hi", "--max-tokens", "2", "--num-blocks", "16"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err == "kiln: error: generation failed: RuntimeError: the kernel failed\n"


def test_ray_serve_settings_it_cannot_use_are_one_line_errors(tmp_path, capsys, monkeypatch):
    # A port in use was a RayTaskError traceback ~30 s in, after Ray had started; no Ray
    # installed, a ModuleNotFoundError traceback; NaN delays, a pydantic traceback inside Ray.
    import importlib.util
    import socket

    from kiln.cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        assert main(["serve", "--ray", "--model-repository", str(tmp_path), "--port", busy]) == 2
        assert f"cannot listen on 127.0.0.1:{busy} (port)" in capsys.readouterr().err
    assert main(["serve", "--ray", "--model-repository", str(tmp_path), "--port", "0",
                 "--ray-upscale-delay-s", "nan"]) == 2
    assert "ray_upscale_delay_s must be a non-negative number, got nan" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert main(["serve", "--ray", "--model-repository", str(tmp_path), "--port", "0"]) == 2
    assert capsys.readouterr().err == "kiln: error: --ray needs Ray Serve: pip install 'ray[serve]'\n"


def test_ray_address_that_answers_nothing_is_one_line(tmp_path, capsys, monkeypatch):
    # Ray retried an unreachable address for minutes before its own traceback.
    import socket

    import kiln.server.preflight as preflight
    from kiln.cli.main import main

    monkeypatch.setattr(preflight, "check_ray_installed", lambda: None)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: connections are refused
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
            assert main(["serve", "--ray", "--ray-address", address, "--model-repository", str(tmp_path)]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"kiln: error: cannot reach the Ray cluster at '{address}' (127.0.0.1:{port}: ")
    for address in ("nohost", "h:0", "h:x", "ray://:10001"):
        assert main(["serve", "--ray", "--ray-address", address, "--model-repository", str(tmp_path)]) == 2
        assert f"ray_address '{address}' is not host:port" in capsys.readouterr().err


def test_serve_exits_2_naming_the_reason_when_its_model_fails_to_load(tmp_path, tiny_llama_dir, capsys):
    # It logged the error four times and exited 1 ("server stopped: ..."), unlike a failure found
    # before the server starts (one `kiln: error:` line, exit 2).
    import shutil

    from kiln.cli.main import main

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "model.safetensors").unlink()
    assert main(["serve", str(model), "--port", "0", "--grpc-port", "-1", "--engine-mode", "thread"]) == 2
    err = capsys.readouterr().err
    assert "kiln: error: server stopped: model: failed to load 'model': no *.safetensors weights" in err, err
