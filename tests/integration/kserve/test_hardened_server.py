"""A server set up as a public one would be (issue 17): an API key, TLS on HTTP
and gRPC (a self-signed certificate made here), model control at its default
(off); and a repository with a model whose failures are not Kiln errors and
an `llm` model whose weights are missing. Checked with the stock clients."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import queue
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.integration.kserve.live import live_server
from tests.unit.serving.models import doubler_config, write_model

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

KEY = "s3cret-key"
AUTH = {"authorization": f"Bearer {KEY}"}

# OUT = IN * 2, except that IN starting with 13 yields text where numbers are
# declared: converting it raises ValueError, which the answer names.
ODD_PY = """
import numpy as np

class Odd:
    def execute(self, requests):
        out = []
        for r in requests:
            x = r.inputs["IN"]
            out.append({"OUT": np.full(x.shape, "boom", dtype=object) if x.flat[0] == 13 else x * 2})
        return out
"""


def self_signed(directory) -> tuple[str, str]:
    """A certificate for 127.0.0.1 / localhost and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardened")
    repo = root / "repo"
    write_model(repo, "odd", doubler_config(), {1: {"model.py": ODD_PY}})
    write_model(repo, "text", {"backend": "python", "max_batch_size": 0,
                               "inputs": [{"name": "T", "datatype": "BYTES", "dims": [-1]}],
                               "outputs": [{"name": "T", "datatype": "BYTES", "dims": [-1]}]},
                {1: {"model.py": "class Echo:\n    def execute(self, requests):\n"
                                 "        return [{'T': r.inputs['T']} for r in requests]\n"}})
    write_model(repo, "llm", {"backend": "llm", "parameters": {"model": "missing.gguf"},
                              "inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]}],
                              "outputs": [{"name": "text_output", "datatype": "BYTES", "dims": [1]}]},
                {1: {"README": "no weights"}})
    cert, key = self_signed(root)
    args = ("--api-key", KEY, "--ssl-certfile", cert, "--ssl-keyfile", key, "--no-strict-readiness")
    with live_server(repo, *args, ca=cert) as live:
        live.cert = cert
        live.repo = repo
        yield live


def grpc_client(server, authorized: bool = True):
    client = grpcclient.InferenceServerClient(server.grpc_url, ssl=True, root_certificates=server.cert)
    return client, (AUTH if authorized else {})


def named(name: str, array: np.ndarray, datatype: str = "FP32"):
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


# ---- the API key on every transport ------------------------------------------


def test_grpc_calls_need_the_key_like_http(server):
    anonymous, _ = grpc_client(server, authorized=False)
    x = np.ones((1, 2), np.float32)
    calls = [
        lambda: anonymous.infer("odd", [named("IN", x)]),
        lambda: anonymous.get_model_config("odd"),
        lambda: anonymous.get_model_repository_index(),
        lambda: anonymous.load_model("odd"),
        lambda: anonymous.unload_model("odd"),
        lambda: anonymous.get_inference_statistics("odd"),
        lambda: anonymous.is_model_ready("odd"),  # names a model, as HTTP's /v2/models/odd/ready does
    ]
    for call in calls:
        with pytest.raises(InferenceServerException) as e:
            call()
        assert "UNAUTHENTICATED" in str(e.value.status()), e.value
    wrong = grpcclient.InferenceServerClient(server.grpc_url, ssl=True, root_certificates=server.cert)
    with pytest.raises(InferenceServerException, match="API key"):
        wrong.infer("odd", [named("IN", x)], headers={"authorization": "Bearer nope"})
    assert anonymous.is_server_live() and anonymous.is_server_ready()  # server health stays open
    assert server.get("/v2/models/odd/ready").status_code == 401

    client, headers = grpc_client(server)
    out = client.infer("odd", [named("IN", x)], headers=headers).as_numpy("OUT")
    assert out.tolist() == [[2.0, 2.0]]
    assert server.post("/v2/models/odd/infer", json={"inputs": []}).status_code == 401
    assert server.get("/v2/health/ready").status_code in (200, 503)  # open, answered


# ---- TLS -----------------------------------------------------------------------


def test_both_ports_speak_tls_only(server):
    assert server.get("/v2/models/odd", headers=AUTH).json()["name"] == "odd"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{server.http_url}/v2/health/live", timeout=5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"https://{server.http_url}/v2/health/live", timeout=5)  # certificate not trusted
    plain = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException):
        plain.is_server_live(client_timeout=5)


# ---- the control plane is off ----------------------------------------------------


def test_model_load_and_unload_are_refused_by_default(server):
    for action in ("load", "unload"):
        r = server.post(f"/v2/repository/models/odd/{action}", headers=AUTH,
                        json={"parameters": {"config": json.dumps({"backend": "llm",
                                                                   "parameters": {"model": "/etc/passwd"}})}})
        assert r.status_code == 403 and "--model-control" in r.json()["error"]
    client, headers = grpc_client(server)
    with pytest.raises(InferenceServerException) as e:
        client.load_model("odd", headers=headers)
    assert "PERMISSION_DENIED" in str(e.value.status())
    assert client.is_model_ready("odd", headers=headers)


# ---- ModelStreamInfer answers every request exactly once --------------------------


def test_stream_answers_each_request_once_even_when_the_model_error_is_not_kilns(server):
    client, headers = grpc_client(server)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)), headers=headers)
    try:
        for i, first in enumerate([1, 13, 2, 13, 3]):
            client.async_stream_infer("odd", [named("IN", np.full((1, 2), first, np.float32))], request_id=str(i))
        got = [responses.get(timeout=30) for _ in range(5)]
        time.sleep(0.3)
        assert responses.empty()  # exactly one answer each
    finally:
        client.stop_stream()
    results = {r.get_response().id: r.as_numpy("OUT").tolist() for r, e in got if e is None}
    errors = [str(e) for _, e in got if e is not None]
    assert results == {"0": [[2.0, 2.0]], "2": [[4.0, 4.0]], "4": [[6.0, 6.0]]}
    assert len(errors) == 2 and all("returned output 'OUT' of object values that are not FP32" in e for e in errors)


# ---- a BYTES shape its data cannot fill is refused before allocating --------------


def test_a_huge_bytes_shape_without_data_is_refused_at_once(server):
    """Four 2^28-element BYTES shapes with no data over HTTP and one over gRPC, in
    flight together with a liveness probe and a well-formed request: each bomb is
    a 400 naming the problem, the probe and the good request are answered at once."""
    header = json.dumps({"inputs": [{"name": "T", "datatype": "BYTES", "shape": [2**28],
                                     "parameters": {"binary_data_size": 0}}]}).encode()

    def http_bomb() -> httpx.Response:
        return server.post("/v2/models/text/infer", content=header,
                           headers={**AUTH, "Inference-Header-Content-Length": str(len(header))})

    def grpc_bomb() -> str:
        client, headers = grpc_client(server)
        empty = grpcclient.InferInput("T", [2**28], "BYTES")
        empty._raw_content = b""  # what a hostile client sends: a shape and no data
        with pytest.raises(InferenceServerException) as e:
            client.infer("text", [empty], headers=headers)
        return str(e.value.status())

    def timed(call):
        started = time.monotonic()
        return call(), time.monotonic() - started

    def good() -> httpx.Response:
        return server.post("/v2/models/text/infer", headers=AUTH,
                           json={"inputs": [{"name": "T", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]})

    with ThreadPoolExecutor(8) as pool:
        bombs = [pool.submit(http_bomb) for _ in range(4)]
        grpc = pool.submit(grpc_bomb)
        probe = pool.submit(timed, lambda: server.get("/v2/health/live"))
        fine = pool.submit(timed, good)
        for bomb in bombs:
            r = bomb.result()
            assert r.status_code == 400 and "string elements" in r.json()["error"], r.text
        assert "INVALID_ARGUMENT" in grpc.result()
        (live, live_s), (r, good_s) = probe.result(), fine.result()
    assert live.status_code == 200 and live_s < 2, live_s
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == ["hi"] and good_s < 5, (r.text, good_s)


# ---- one model failing to load leaves the others serving ---------------------------


def test_an_llm_without_weights_is_unavailable_and_the_server_goes_on(server):
    health = server.get("/health").json()
    assert health["models"] == {"odd": "ready", "text": "ready", "llm": "unavailable"}
    index = {row["name"]: row for row in server.post("/v2/repository/index", headers=AUTH, json={}).json()}
    assert index["llm"]["state"] == "UNAVAILABLE" and "missing.gguf" in index["llm"]["reason"]
    assert str(server.repo) not in index["llm"]["reason"]
    assert server.alive()


def test_tls_handshake_garbage_does_not_hurt(server):
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(b"\x16\x03\x01\x00\x05hello" * 10)
        sock.settimeout(10)
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            sock.recv(100)
    context = ssl.create_default_context(cafile=server.cert)
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock, \
            context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
        tls.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert tls.recv(100).startswith(b"HTTP/1.1 200")
