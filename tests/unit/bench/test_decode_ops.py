"""bench/decode_ops.py's arithmetic: per-step times, shares of the layers,
projection rates and the time between the timed ops, on made-up totals."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import decode_ops  # noqa: E402

from kiln.llm.kernels.ops import OpTime  # noqa: E402


def test_summary_per_step_shares_rates_and_the_rest():
    ops = {"qkv": OpTime(0.004, 60), "attention": OpTime(0.002, 60), "rope": OpTime(0.0, 0),
           "layer": OpTime(0.010, 60)}  # two steps of 30 layers
    r = decode_ops.summarize("int8", ops, 2.0, 0.006, {"qkv": 1_000_000})
    assert r["layers_us"] == pytest.approx(5000) and r["outside_layers_us"] == pytest.approx(1000)
    assert r["ops"]["qkv"] == pytest.approx({"us_per_step": 2000, "share_of_layers": 0.4, "GBps": 0.5})
    assert r["ops"]["attention"] == pytest.approx({"us_per_step": 1000, "share_of_layers": 0.2})
    assert "rope" not in r["ops"] and "layer" not in r["ops"]  # never called; the whole, not an op
    assert r["ops"]["between ops"] == pytest.approx({"us_per_step": 2000, "share_of_layers": 0.4})


def test_unknown_modes_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["decode_ops.py", "--modes", "int8,fp64"])
    with pytest.raises(SystemExit) as done:
        decode_ops.main()
    assert done.value.code == 2 and "fp64" in capsys.readouterr().err
