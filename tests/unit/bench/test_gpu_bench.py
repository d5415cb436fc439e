"""The CPU side of the GPU check: bench/gpu_bench.py's arguments, bytes
count and table, and bench/device_check.sh --dry-run (the figures themselves
need a GPU)."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.llama import LlamaModel

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_bench  # noqa: E402


def test_arguments():
    args = gpu_bench.parse_args([])
    assert args.models == ["Llama-3.2-1B", "Llama-3.1-8B"] and args.batches == [64, 128, 256]
    args = gpu_bench.parse_args(["--models", "Llama-3.1-8B", "--batches", "8,16", "--gen-len", "5"])
    assert args.models == ["Llama-3.1-8B"] and args.batches == [8, 16] and args.gen_len == 5
    for bad in (["--models", "Llama-2"], ["--batches", "0"], ["--gen-len", "1"]):
        with pytest.raises(SystemExit):
            gpu_bench.parse_args(bad)


def test_the_table_has_one_row_per_figure_and_ratios_where_there_is_a_reference():
    report = gpu_bench.fake_report()
    lines = gpu_bench.render(report).splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].startswith("| model | measure | Kiln | HF transformers generate |")
    assert len(table) == 1 + len(report.rows)
    assert "| 190.0 | 40.0 | 4.75x |" in table[1] and "| 3,000.0 | - | - | 70% of copy |" in table[2]


def test_fake_run_writes_json(tmp_path, capsys):
    assert gpu_bench.main(["--fake", "--json", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["rows"][0] == dataclasses.asdict(gpu_bench.fake_report().rows[0])
    assert "| model |" in capsys.readouterr().out


@pytest.mark.parametrize("tied", [True, False])
def test_bytes_read_per_step_skip_the_embedding_table_unless_it_is_the_head(tied):
    arch = LlamaArch(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                     tie_word_embeddings=tied)
    model = LlamaModel(arch, 64).to(torch.bfloat16)
    layers = sum(p.numel() for p in model.layers.parameters()) * 2
    head_and_norm = (100 * 16 + 16) * 2
    kv = 10 * 2 * 2 * 1 * 8 * 2  # 10 tokens, k and v, 2 layers, 1 kv head, dim 8, bf16
    assert gpu_bench.read_bytes_per_step(model, arch, context=10) == layers + head_and_norm + kv


def test_device_check_dry_run_on_a_cpu_machine():
    env = {**os.environ, "PYTHON": sys.executable, "OUT": ""}
    proc = subprocess.run(["bash", str(ROOT / "bench/device_check.sh"), "--dry-run"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "== environment" in proc.stdout and "would run:" in proc.stdout
    assert "tests collected" in proc.stdout and "| model | measure | Kiln |" in proc.stdout
