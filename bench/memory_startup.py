"""Where an LLM engine's memory and start-up time go (default: the installed SmolLM2 Q4_1 GGUF).

Three measurements, each in a fresh process:

    phases   one Python process builds an engine as `kiln generate` does (LLM(...)), timing each
             phase (imports, kernel load, checkpoint read with dequantization, model build, finish:
             quantize/cast/pack/fuse, KV alloc, the rest of engine set-up, first token) and reading
             its RSS after each; after warm-up the RSS is broken down into weights in the serving
             layout, packed copies, KV pool, and the rest (torch, libraries, activations)
    serve    `kiln serve` (no model flag: the default model) from process start to /health 200,
             then one completion as warm-up; the engine process's RSS and what /metrics reports
    generate `kiln generate --max-tokens 8` from process start to exit

    .venv/bin/python bench/memory_startup.py [--model PATH] [--kv-cache-memory-gib G] [--skip serve,generate]

Figures go in docs/benchmarks.md (Memory and start-up of the engine).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
PROMPT = "The history of the printing press begins " * 12  # a prefill above the packed-weight threshold
MIB = 2**20


def rss_bytes(pid: int | str = "self") -> int:
    return _status_kib(pid, "VmRSS") * 1024


def peak_rss_bytes(pid: int | str = "self") -> int:
    return _status_kib(pid, "VmHWM") * 1024


def _status_kib(pid: int | str, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


# ---- phases (child process) ---------------------------------------------------------


class Phases:
    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.last = self.started
        self.rows: list[tuple[str, float, int]] = []

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.rows.append((name, now - self.last, rss_bytes()))
        self.last = now


def timed(phases: Phases, name: str, fn, gap: str = "other set-up"):
    """`fn`, its calls timed as phase `name`; time since the last mark is `gap`."""
    def wrapper(*args, **kwargs):
        phases.mark(gap)
        result = fn(*args, **kwargs)
        phases.mark(name)
        return result
    return wrapper


def run_phases(model: str | None, kv_gib: float | None) -> dict:
    phases = Phases()
    import torch  # noqa: F401

    phases.mark("import torch")
    from kiln.llm import llm as llm_module
    from kiln.llm.engine import builder, llm_engine
    from kiln.llm.kernels import ops
    from kiln.llm.models import llama
    from kiln.llm.sampling_params import SamplingParams

    phases.mark("import kiln (+ transformers)")
    ops.loaded_library()
    phases.mark("kernel library load")
    builder.load_checkpoint = timed(phases, "checkpoint read (+ dequantization)", builder.load_checkpoint)
    finish = llama.LlamaModel.finish
    llama.pack_for_prefill = timed(phases, "packing (projections)", llama.pack_for_prefill, "finish: settle, cast")
    llama.copy_for_many_rows = timed(phases, "packing (LM head)", llama.copy_for_many_rows, "finish: other")

    def finish_timed(self, *args, **kwargs):
        phases.mark("model build + weight copy")
        result = finish(self, *args, **kwargs)
        phases.mark("finish: fused-decode tensors")
        return result

    llama.LlamaModel.finish = finish_timed
    builder.keep_prefill_copies = timed(phases, "int4 prefill copies (bf16)", builder.keep_prefill_copies)
    builder.ModelRunner = timed(phases, "KV pool alloc", builder.ModelRunner, "KV sizing")
    if hasattr(builder, "trim_heap"):
        builder.trim_heap = timed(phases, "checkpoint release + heap trim", builder.trim_heap)
    llm_engine.load_tokenizer = timed(phases, "tokenizer load", llm_engine.load_tokenizer)
    options = {} if kv_gib is None else {"kv_cache_memory_gib": kv_gib}
    llm = llm_module.LLM(model, **options)
    phases.mark("other set-up")
    engine = llm.engine
    engine.add_request("warm-up", PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
    while not any(out.outputs[0].token_ids for out in engine.step()):
        pass
    phases.mark("first token (prefill)")
    while engine.has_unfinished():
        engine.step()
    phases.mark("7 more tokens")
    return {
        "phases": merged(phases.rows),
        "total_s": time.perf_counter() - phases.started,
        "breakdown": breakdown(llm),
        "peak_rss": peak_rss_bytes(),
        "checkpoints_alive": checkpoints_alive(),
    }


def merged(rows: list[tuple[str, float, int]]) -> list[tuple[str, float, int]]:
    """Rows of one name summed (seconds; the last RSS), in first-seen order; empty gaps dropped."""
    out: dict[str, tuple[str, float, int]] = {}
    for name, seconds, rss in rows:
        previous = out.get(name, (name, 0.0, 0))
        out[name] = (name, previous[1] + seconds, rss)
    return [row for row in out.values() if row[1] >= 0.005]


def breakdown(llm) -> dict[str, int]:
    """The engine's tensors by kind (the KV pool: the pages written so far), and the RSS that is none of them."""
    runner = llm.engine.core.runner
    model = runner.model
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    weights = sum(t.numel() * t.element_size() for t in unique.values())
    packed_tensors = [p for m in model.modules() if (p := getattr(m, "packed", None)) is not None]
    if getattr(model, "lm_head_packed", None) is not None:
        packed_tensors.append(model.lm_head_packed)
    packed = sum(t.numel() * t.element_size() for t in packed_tensors)
    kv_reserved = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    kv_resident = sum(resident_bytes(t) for t in runner.kv_caches)
    rss = rss_bytes()
    return {"rss": rss, "weights": weights, "packed": packed, "kv_pool_reserved": kv_reserved,
            "kv_pool_resident": kv_resident, "other": rss - weights - packed - kv_resident}


def resident_bytes(tensor) -> int:
    """Bytes of `tensor`'s pages that are in memory (present bits of /proc/self/pagemap)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = f.read((end - start) * 8)
    present = sum(1 for i in range(7, len(entries), 8) if entries[i] & 0x80)
    return present * page


def checkpoints_alive() -> int:
    """Bytes of float weights held by Checkpoint objects still alive (should be 0 after build)."""
    import gc

    from kiln.llm.models.checkpoint import Checkpoint

    alive = [o for o in gc.get_objects() if isinstance(o, Checkpoint)]
    return sum(t.numel() * t.element_size() for c in alive for t in c.weights.values())


# ---- kiln serve / kiln generate --------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def engine_pid(server_pid: int) -> int | None:
    for pid in children(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"kiln.llm.engine.core_proc" in cmdline:
            return pid
    return None


def get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def run_serve(extra: list[str]) -> dict:
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [str(BIN / "kiln"), "serve", "--port", str(port), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        while get(base + "/health")[0] != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            time.sleep(0.05)
        ready_s = time.perf_counter() - started
        body = json.dumps({"model": "default", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        models = json.loads(get(base + "/v1/models")[1])["data"]
        request.data = json.dumps({**json.loads(body), "model": models[0]["id"]}).encode()
        with urllib.request.urlopen(request, timeout=60) as r:
            r.read()
        pid = engine_pid(proc.pid)
        metrics = get(base + "/metrics")[1]
        gauges = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^kiln:model_memory_bytes\{[^}]*kind="(\w+)"[^}]*\} (\S+)', metrics, re.M)}
        return {
            "ready_s": ready_s,
            "engine_rss": rss_bytes(pid) if pid else None,
            "engine_peak_rss": peak_rss_bytes(pid) if pid else None,
            "server_rss": rss_bytes(proc.pid),
            "metrics": gauges,
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_generate(extra: list[str]) -> dict:
    started = time.perf_counter()
    subprocess.run(
        [str(BIN / "kiln"), "generate", "--prompt", "Hello", "--max-tokens", "8", *extra],
        check=True, capture_output=True,
    )
    return {"total_s": time.perf_counter() - started}


# ---- report --------------------------------------------------------------------------


def print_phases(result: dict) -> None:
    print(f"{'phase':<42} {'seconds':>8} {'RSS after (MiB)':>16}")
    for name, seconds, rss in result["phases"]:
        print(f"{name:<42} {seconds:>8.2f} {rss / MIB:>16.0f}")
    print(f"{'total (process start to 8 tokens)':<42} {result['total_s']:>8.2f}")
    b = result["breakdown"]
    print("RSS after warm-up: " + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in b.items()))
    print(f"peak RSS {result['peak_rss'] / MIB:.0f} MiB; float weights of Checkpoints still alive: "
          f"{result['checkpoints_alive'] / MIB:.0f} MiB")
    served = b["weights"] + b["packed"] + b["kv_pool_reserved"]
    target = 1.25 * served + 300e6
    print(f"target RSS <= 1.25 x (weights + packed + KV reserved) + 300 MB = {target / MIB:.0f} MiB: "
          f"{'met' if b['rss'] <= target else 'NOT met'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=None)
    parser.add_argument("--skip", default="", help="comma-separated: phases, serve, generate")
    parser.add_argument("--child-phases", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_phases:
        print(json.dumps(run_phases(args.model, args.kv_cache_memory_gib)))
        return 0
    skip = set(filter(None, args.skip.split(",")))
    extra = [*([args.model] if args.model else []),
             *(["--kv-cache-memory-gib", str(args.kv_cache_memory_gib)] if args.kv_cache_memory_gib else [])]
    if "phases" not in skip:
        command = [sys.executable, __file__, "--child-phases", *sys.argv[1:]]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        print_phases(json.loads(out.strip().splitlines()[-1]))
    if "serve" not in skip:
        s = run_serve(extra)
        print(f"kiln serve: /health ready after {s['ready_s']:.2f}s; after one completion: engine RSS "
              f"{s['engine_rss'] / MIB:.0f} MiB (peak {s['engine_peak_rss'] / MIB:.0f}), API process "
              f"{s['server_rss'] / MIB:.0f} MiB; /metrics kiln:model_memory_bytes: "
              + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in sorted(s["metrics"].items())))
    if "generate" not in skip:
        g = run_generate(extra)
        print(f"kiln generate --max-tokens 8: {g['total_s']:.2f}s from process start to exit")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs")
    return 0


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
