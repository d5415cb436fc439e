"""`kiln bench infer`: a concurrency sweep against a KServe v2 endpoint.

For each concurrency level, that many workers send requests back to back
(closed loop) for `--duration` seconds over HTTP (binary tensors) or gRPC
(raw_input_contents); we report requests/s, inferences/s (rows) and latency
percentiles. Inputs are random, shaped from the model's metadata (`-1` dims
become `--batch-size` for the batch dim, `--dim` for the others).

    kiln bench infer --model breast_cancer --protocol grpc --url 127.0.0.1:8001 \
        --concurrency 1,8,32 --duration 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import ConfigError, InvalidRequestError, KilnError, RequestFailedError
from kiln.frontends.kserve.grpc.stubs import load_stubs
from kiln.serving.codecs.tensors import to_raw
from kiln.serving.types import datatype_of, numpy_dtype

PERCENTILES = (50, 90, 99)
# gRPC codes that mean the request was at fault (the HTTP 4xx of gRPC).
GRPC_CLIENT_CODES = ("INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION",
                     "UNAUTHENTICATED", "PERMISSION_DENIED")


@dataclass
class Level:
    concurrency: int
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    duration_s: float = 0.0
    rows: int = 0

    def summary(self) -> dict:
        lat = np.array(self.latencies_s) * 1000 if self.latencies_s else np.zeros(1)
        done = len(self.latencies_s)
        return {
            "concurrency": self.concurrency,
            "requests": done,
            "errors": self.errors,
            "throughput_rps": done / self.duration_s if self.duration_s else 0.0,
            "inferences_per_s": done * self.rows / self.duration_s if self.duration_s else 0.0,
            **{f"p{p}_ms": float(np.percentile(lat, p)) for p in PERCENTILES},
            "mean_ms": float(lat.mean()),
            "first_error": self.first_error,
        }


def make_inputs(metadata: dict, batch_size: int, dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    inputs = {}
    for spec in metadata["inputs"]:
        shape = [int(d) for d in spec["shape"]]
        shape = [(batch_size if i == 0 else dim) if d < 0 else d for i, d in enumerate(shape)]
        dtype = numpy_dtype(spec["datatype"])
        if spec["datatype"] == "BYTES":
            inputs[spec["name"]] = np.full(shape, b"kiln", dtype=object)
        elif dtype.kind == "f":
            inputs[spec["name"]] = rng.random(shape).astype(dtype)
        else:
            inputs[spec["name"]] = rng.integers(0, 2, shape).astype(dtype)
    return inputs


def _refusal(status: str, client_fault: bool, where: str, message: str) -> KilnError:
    """The server's refusal as one line: a 4xx is the request's fault, anything else the server's."""
    text = " ".join(str(message).split())[:300] or "(no message)"
    return (InvalidRequestError if client_fault else RequestFailedError)(f"{status} from {where}: {text}")


def _http_refusal(response) -> KilnError:
    try:  # Kiln (and KServe servers) answer errors as {"error": message}
        message = response.json().get("error") or response.text
    except (ValueError, AttributeError):
        message = response.text
    return _refusal(f"HTTP {response.status_code}", 400 <= response.status_code < 500, str(response.url), message)


class HttpTarget:
    def __init__(self, url: str, model: str):
        import httpx

        self.base = url if url.startswith("http") else f"http://{url}"
        self.model = model
        try:
            self.client = httpx.AsyncClient(base_url=self.base, timeout=60,
                                            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
        except httpx.InvalidURL as exc:
            raise ConfigError(f"--url {url!r} is not a valid URL: {exc}", param="url") from None
        port = httpx.URL(self.base).port
        if port is not None and not 0 < port <= 65535:  # connect() raised a bare OverflowError
            raise ConfigError(f"--url {url!r}: the port must be in [1, 65535]", param="url")

    async def _send(self, method: str, path: str, **kwargs):
        import httpx

        try:
            response = await self.client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            # Connection refused, DNS failure, timeout: say where, not an httpx traceback.
            raise ConfigError(f"cannot reach the server at {self.base}: {exc or type(exc).__name__}",
                              param="url") from None
        if response.status_code != 200:
            raise _http_refusal(response)
        return response

    async def metadata(self) -> dict:
        return (await self._send("GET", f"/v2/models/{self.model}")).json()

    def prepare(self, inputs: dict[str, np.ndarray]):
        raws = {k: to_raw(v) for k, v in inputs.items()}
        header = json.dumps({"inputs": [
            {"name": k, "datatype": _datatype(v), "shape": list(v.shape),
             "parameters": {"binary_data_size": len(raws[k])}}
            for k, v in inputs.items()], "parameters": {"binary_data_output": True}}).encode()
        body = header + b"".join(raws.values())
        return body, {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}

    async def infer(self, prepared) -> None:
        body, headers = prepared
        await self._send("POST", f"/v2/models/{self.model}/infer", content=body, headers=headers)

    async def close(self) -> None:
        await self.client.aclose()


class GrpcTarget:
    def __init__(self, url: str, model: str):
        import grpc

        self.pb2, pb2_grpc = load_stubs()
        self.url = url
        self.model = model
        self.channel = grpc.aio.insecure_channel(url, options=[("grpc.max_receive_message_length", 1 << 30),
                                                               ("grpc.max_send_message_length", 1 << 30)])
        self.stub = pb2_grpc.GRPCInferenceServiceStub(self.channel)

    async def metadata(self) -> dict:
        from google.protobuf import json_format

        request = self.pb2.ModelMetadataRequest(name=self.model)
        response = await self._call(self.stub.ModelMetadata, request)
        return json_format.MessageToDict(response, preserving_proto_field_name=True)

    async def _call(self, method, request):
        import grpc

        try:
            return await method(request, timeout=60)
        except grpc.aio.AioRpcError as exc:
            # An unreachable server is UNAVAILABLE with "failed to connect" in its details.
            code = exc.code().name
            raise _refusal(f"gRPC {code}", code in GRPC_CLIENT_CODES, self.url, exc.details() or "") from None

    def prepare(self, inputs: dict[str, np.ndarray]):
        request = self.pb2.ModelInferRequest(model_name=self.model)
        for name, value in inputs.items():
            tensor = request.inputs.add(name=name, datatype=_datatype(value))
            tensor.shape.extend(value.shape)
            request.raw_input_contents.append(to_raw(value))
        return request

    async def infer(self, prepared) -> None:
        await self._call(self.stub.ModelInfer, prepared)

    async def close(self) -> None:
        await self.channel.close()


def _datatype(value: np.ndarray) -> str:
    return datatype_of(value)


async def run_level(target, prepared, concurrency: int, duration_s: float, rows: int) -> Level:
    level = Level(concurrency, rows=rows)
    deadline = time.perf_counter() + duration_s

    async def worker():
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            try:
                await target.infer(prepared)
            except Exception as exc:  # noqa: BLE001 - counted, first one reported
                level.errors += 1
                level.first_error = level.first_error or f"{type(exc).__name__}: {exc}"[:300]
                continue
            level.latencies_s.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    level.duration_s = time.perf_counter() - start
    return level


async def sweep(protocol: str, url: str, model: str, concurrency: list[int], duration_s: float,
                batch_size: int = 1, dim: int = 1, warmup: int = 5) -> list[dict]:
    target = (GrpcTarget if protocol == "grpc" else HttpTarget)(url, model)
    try:
        metadata = await target.metadata()
        prepared = target.prepare(make_inputs(metadata, batch_size, dim))
        for _ in range(warmup):
            await target.infer(prepared)
        results = []
        for c in concurrency:
            results.append((await run_level(target, prepared, c, duration_s, batch_size)).summary())
        return results
    finally:
        await target.close()


def format_table(results: list[dict], title: str) -> str:
    lines = [title, f"{'conc':>5} {'req/s':>9} {'inf/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'errors':>6}"]
    for r in results:
        lines.append(f"{r['concurrency']:>5} {r['throughput_rps']:>9.1f} {r['inferences_per_s']:>9.1f} "
                     f"{r['p50_ms']:>8.2f} {r['p90_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['errors']:>6}")
    return "\n".join(lines)


# argparse types: a bad value is a one-line "argument --x: ..." usage error (exit 2)
# before any connection is made, instead of a traceback or a sweep of zeros.
def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):  # nan fails `> 0` too
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    return value


def concurrency_levels(text: str) -> list[int]:
    parts = [c.strip() for c in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [positive_int(c) for c in parts if c]


def add_bench_infer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8000 http / :8001 grpc)")
    p.add_argument("--concurrency", type=concurrency_levels, default=[1, 8, 32], metavar="N[,N...]",
                   help="comma-separated levels (default: 1,8,32)")
    p.add_argument("--duration", type=positive_seconds, default=5.0, help="seconds per level")
    p.add_argument("--batch-size", type=positive_int, default=1, help="rows per request (models that batch)")
    p.add_argument("--dim", type=positive_int, default=1, help="size used for other variable dims")
    p.add_argument("--json", dest="json_path", help="also write the results here")


def main_bench_infer(args: argparse.Namespace) -> int:
    """Run the sweep. An unreachable server, or one that refuses the metadata or warm-up
    requests (e.g. --batch-size above the model's max_batch_size), raises a KilnError
    naming the URL and the server's answer before any level runs."""
    if args.url is not None and not args.url.strip():  # '' meant the default server, silently
        raise ConfigError("--url must not be empty (leave it out for 127.0.0.1:8000 / :8001)", param="url")
    url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    results = asyncio.run(sweep(args.protocol, url, args.model, args.concurrency, args.duration,
                                args.batch_size, args.dim))
    print(format_table(results, f"{args.model} over {args.protocol} at {url}"))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if any(r["errors"] for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln bench infer")
    add_bench_infer_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main_bench_infer(args)
    except KilnError as exc:  # as `kiln` itself reports them (kiln/cli/main.py)
        print(f"{parser.prog}: error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
