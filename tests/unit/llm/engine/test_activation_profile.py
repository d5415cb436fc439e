"""The start-up activation profile (--profile-activations): the peak is read
from the process's high-water mark after a reset, above a baseline taken
with the scratch KV pool already resident; where the peak cannot be reset
nothing is reported."""
from pathlib import Path

import pytest
import torch

from kiln.llm.engine.activation_profile import HostPeak, measure_activation_peak, status_bytes
from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.llama import LlamaModel

ARCH = LlamaArch(
    vocab_size=4096, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
    tie_word_embeddings=True, rope_scaling=None, bos_token_id=1, eos_token_ids=(2,),
)


def model() -> LlamaModel:
    torch.manual_seed(0)
    m = LlamaModel(ARCH, max_positions=1024)
    for p in m.parameters():
        p.data.normal_(0, 0.05)
    return m.finish(torch.device("cpu"), torch.float32, None, group_size=32)


class FakeMeter:
    def __init__(self, can_reset: bool):
        self.can_reset, self.started = can_reset, 0

    def start(self) -> bool:
        self.started += 1
        return self.can_reset

    def peak(self) -> int:
        return 123


def test_status_fields_are_read_in_bytes(tmp_path: Path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n")
    assert status_bytes("VmRSS", status) == 1024 * 1024 and status_bytes("VmHWM", status) == 2048 * 1024
    assert status_bytes("VmSwap", status) is None and status_bytes("VmRSS", tmp_path / "absent") is None


def test_host_peak_is_the_high_water_mark_above_the_baseline(tmp_path: Path):
    status, clear_refs = tmp_path / "status", tmp_path / "clear_refs"
    status.write_text("VmHWM:\t1000 kB\nVmRSS:\t1000 kB\n")
    meter = HostPeak(status, clear_refs)
    assert meter.start() and clear_refs.read_text() == "5"  # the kernel's "reset the peak RSS"
    status.write_text("VmHWM:\t1600 kB\nVmRSS:\t1100 kB\n")
    assert meter.peak() == 600 * 1024


def test_a_peak_that_cannot_be_reset_is_not_reported(tmp_path: Path):
    refused = HostPeak(tmp_path / "status", tmp_path / "no" / "such" / "clear_refs")
    assert not refused.start()
    assert measure_activation_peak(model(), 64, 8, 16, torch.device("cpu"), meter=FakeMeter(False)) is None


def test_the_meter_brackets_one_forward_of_the_largest_step():
    meter = FakeMeter(True)
    assert measure_activation_peak(model(), 64, 8, 16, torch.device("cpu"), meter=meter) == 123
    assert meter.started == 1


@pytest.mark.skipif(not HostPeak().start(), reason="this kernel refuses /proc/self/clear_refs")
def test_the_measured_host_peak_covers_the_step_logits():
    # 1000 tokens, all sampled: their fp32 logits (1000 x 4096 x 4 = 16 MB) are live at the peak. Twice:
    # the second run's allocations would reuse the first's freed (still resident) heap without the trim.
    m = model()
    for _ in range(2):
        peak = measure_activation_peak(m, 1000, 1000, 16, torch.device("cpu"))
        assert peak is not None and peak >= 1000 * 4096 * 4
