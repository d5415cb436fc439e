"""ISA detection and dispatch: levels from fake flag sets, KILN_ISA forcing,
which build each level loads; and, in fresh processes (a process loads one
build for good), that KILN_ISA really changes the library and the ops."""
import json
import os
import subprocess
import sys

import pytest

from kiln.errors import ConfigError
from kiln.llm.kernels import isa, ops
from kiln.llm.kernels.build import BUILDS

ZEN3 = frozenset(["fpu", "sse", "sse2", "avx", "fma", "f16c", "avx2", "bmi2"])
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ICE_LAKE = SKYLAKE_SP | {"avx512_vnni", "avx512vbmi"}
ZEN4 = SKYLAKE_SP | {"avx512_bf16", "avx512_vnni", "avx512vbmi"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu
"""


def test_cpuinfo_flags_come_from_the_first_flags_line():
    flags = isa.parse_cpuinfo_flags(CPUINFO)
    assert {"avx2", "avx512_bf16", "avx512_vnni"} <= flags and "sysret_ss_attrs" not in flags
    assert isa.level_of(flags) == "avx512_bf16"
    assert isa.parse_cpuinfo_flags("no flags here") == frozenset()


@pytest.mark.parametrize(
    "flags,level",
    [
        (frozenset({"sse2", "avx"}), "none"),
        (ZEN3 - {"f16c"}, "none"),  # every level needs all of its features
        (ZEN3, "avx2"),
        (SKYLAKE_SP, "avx512"),
        (ZEN4, "avx512_bf16"),
        (ICE_LAKE, "avx512_vnni"),
        (ZEN4 - {"avx512_vnni"}, "avx512"),  # bf16 dot products come with VNNI in every CPU that has them
        (SAPPHIRE_RAPIDS, "amx"),
        (ZEN3 | {"amx_tile", "amx_bf16", "amx_int8"}, "avx2"),  # levels are cumulative
    ],
)
def test_level_of_fake_flag_sets(flags, level):
    assert isa.level_of(flags) == level


def test_each_level_loads_the_build_it_can_run():
    assert [isa.LIBRARY_FOR_LEVEL[level] for level in isa.LEVELS] == [
        None, "avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx512_bf16"]
    assert set(isa.LIBRARY_FOR_LEVEL.values()) - {None} == set(BUILDS)


@pytest.mark.parametrize(
    "detected,requested,expected",
    [
        ("avx512_bf16", None, ("avx512_bf16", False)),
        ("avx512_bf16", "", ("avx512_bf16", False)),
        ("avx512_bf16", "avx2", ("avx2", True)),
        ("amx", " AVX512_BF16 ", ("avx512_bf16", True)),
        ("avx512_bf16", "avx512_vnni", ("avx512_vnni", True)),
        ("avx2", "avx2", ("avx2", True)),
    ],
)
def test_kiln_isa_forces_a_level_at_or_below_the_cpus(detected, requested, expected):
    assert isa.resolve(detected, requested) == expected


def test_kiln_isa_above_the_cpu_or_unknown_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"KILN_ISA=amx asks for more than this CPU has \(its level is avx2\)"):
        isa.resolve("avx2", "amx")
    levels = "avx2, avx512, avx512_vnni, avx512_bf16, amx"
    with pytest.raises(ConfigError, match=f"KILN_ISA must be one of {levels}, got 'sse4'"):
        isa.resolve("amx", "sse4")
    with pytest.raises(ConfigError, match="must be one of"):
        isa.resolve("amx", "none")  # not a level one can force: KILN_KERNELS=0 turns the kernels off


@pytest.mark.parametrize(
    "level,dtype",
    [("avx2", "float32"), ("avx512", "float32"), ("avx512_vnni", "float32"), ("avx512_bf16", "bfloat16"),
     ("amx", "bfloat16")],
)
def test_preferred_cpu_dtype_is_bf16_where_the_cpu_has_bf16_dot_products(monkeypatch, level, dtype):
    monkeypatch.setattr(isa, "cpu_isa", lambda: isa.IsaChoice("amx", level, level != "amx", SAPPHIRE_RAPIDS))
    assert isa.preferred_cpu_dtype() == dtype


@pytest.mark.parametrize(
    "level,builds",
    [("none", []), ("avx2", ["avx2"]), ("avx512", ["avx512", "avx2"]),
     ("avx512_vnni", ["avx512_vnni", "avx512", "avx2"]),
     ("avx512_bf16", ["avx512_bf16", "avx512_vnni", "avx512", "avx2"]),
     ("amx", ["avx512_bf16", "avx512_vnni", "avx512", "avx2"])],
)
def test_a_level_tries_its_build_then_the_lower_ones(level, builds):
    assert ops._builds_to_try(isa.IsaChoice(level, level, False, frozenset())) == builds


def test_the_choice_is_described_in_one_line():
    choice = isa.IsaChoice("avx512_bf16", "avx2", True, ZEN4)
    text = choice.describe()
    assert text.startswith("kiln kernels: ISA avx2 (forced by KILN_ISA: yes; CPU level avx512_bf16; library avx2;")
    assert "avx512_bf16" in text and "avx512vbmi" not in text  # only the features Kiln knows of


PROBE = """
import json, logging, torch
logging.basicConfig(level=logging.INFO)
from kiln.llm.kernels import isa, ops
library = ops.loaded_library()
x, w = torch.randn(8, 576).bfloat16().float(), torch.randn(16, 576).bfloat16()  # fp32 out: every bit shows
same = torch.equal(torch.ops.kiln.linear_bf16(x, w), torch.ops.kiln.linear_bf16_widen(x, w))
w8, scales = torch.randint(-127, 128, (16, 576), dtype=torch.int8), torch.rand(16)
int8_x = not torch.equal(torch.ops.kiln.linear_w8(x, w8, scales), torch.ops.kiln.linear_w8_fp32x(x, w8, scales))
print(json.dumps({"level": isa.cpu_isa().level, "library": library, "dots": ops.bf16_dot_products(),
                  "same_as_widen": same, "vnni": ops.vnni_int8(), "int8_x": int8_x}))
"""


def probe(env_isa: str | None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_ISA", "KILN_KERNELS")}
    if env_isa is not None:
        env["KILN_ISA"] = env_isa
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.skipif(not all(b.library.exists() for b in BUILDS.values()), reason="kernel builds absent")
@pytest.mark.skipif(not isa.cpu_isa().at_least("avx512_bf16") or isa.cpu_isa().forced,
                    reason="needs an AVX512_BF16 CPU and no KILN_ISA in the environment")
def test_kiln_isa_changes_the_loaded_library_and_the_bf16_kernel():
    default, log = probe(None)
    assert default == {"level": isa.cpu_isa().detected, "library": "avx512_bf16", "dots": True,
                       "same_as_widen": False,  # vdpbf16ps sums pairs: other bits than fp32 FMAs
                       "vnni": True, "int8_x": True}
    assert "forced by KILN_ISA: no" in log and "loaded _kiln_kernels_avx512_bf16-" in log
    forced, log = probe("avx2")
    assert forced == {"level": "avx2", "library": "avx2", "dots": False, "same_as_widen": True, "vnni": False,
                      "int8_x": False}
    assert "ISA avx2 (forced by KILN_ISA: yes" in log and "loaded _kiln_kernels_avx2-" in log


@pytest.mark.skipif(not all(b.library.exists() for b in BUILDS.values()), reason="kernel builds absent")
@pytest.mark.skipif(not isa.cpu_isa().at_least("avx512_vnni") or isa.cpu_isa().forced,
                    reason="needs an AVX512_VNNI CPU and no KILN_ISA in the environment")
def test_kiln_isa_avx512_vnni_loads_int8_dot_products_without_bf16_ones():
    vnni, log = probe("avx512_vnni")
    assert vnni == {"level": "avx512_vnni", "library": "avx512_vnni", "dots": False, "same_as_widen": True,
                    "vnni": True, "int8_x": True}  # int8 weights on VNNI: x quantized, other bits
    assert "loaded _kiln_kernels_avx512_vnni-" in log
    plain, log = probe("avx512")
    assert plain == {"level": "avx512", "library": "avx512", "dots": False, "same_as_widen": True, "vnni": False,
                     "int8_x": False}
    assert "loaded _kiln_kernels_avx512-" in log


@pytest.mark.skipif(isa.cpu_isa().detected == "amx", reason="the CPU has AMX: nothing above it to refuse")
def test_forcing_a_level_above_the_cpu_fails_at_load_with_the_reason():
    env = {**os.environ, "KILN_ISA": "amx"}
    done = subprocess.run([sys.executable, "-c", "from kiln.llm.kernels import ops; ops.kernels_loaded()"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "KILN_ISA=amx asks for more than this CPU has" in done.stderr
