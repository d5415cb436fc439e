"""Which instruction sets the CPU offers, and which of Kiln's kernel builds to use.

The CPU's features are read once (Linux: the `flags` line of /proc/cpuinfo,
which names Intel's and AMD's features alike; elsewhere torch's own
capability probe, which only tells AVX2 from AVX-512). They map to one
level of an ordered list:

    avx2         AVX2 + FMA + F16C (Haswell, Zen 1-3)
    avx512       + AVX-512 F/BW/VL/DQ (Skylake-SP)
    avx512_vnni  + AVX512_VNNI (Cascade Lake, Ice Lake)
    avx512_bf16  + AVX512_BF16 (Cooper Lake, Zen 4 and 5)
    amx          + AMX tiles for bf16 and int8 (Sapphire Rapids and later)

Each level loads one kernel library (`LIBRARY_FOR_LEVEL`): there are four
builds, `avx2`, `avx512` (the avx2 sources with the compute-bound int4
kernels, decode attention and gating sixteen lanes wide), `avx512_vnni` (the
avx512 build plus int8 dot products for int8 weights) and `avx512_bf16`.
Kiln has no AMX tile code: AMX is reached through oneDNN, which torch's
bf16 and int8 matmuls use by themselves where the CPU has it.

`KILN_ISA=<level>` forces a level at or below the CPU's (to test every
path on one machine, and for A/B runs); one above it is an error.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.errors import ConfigError

log = logging.getLogger(__name__)

LEVELS = ("none", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
# The cpuinfo flags each level adds to the one below it.
LEVEL_FLAGS = {
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_vnni": frozenset({"avx512_vnni"}),
    "avx512_bf16": frozenset({"avx512_bf16"}),
    "amx": frozenset({"amx_tile", "amx_bf16", "amx_int8"}),
}
# Features reported in the log besides the levels' own.
EXTRA_FLAGS = ("avx512_fp16", "avx_vnni", "avx_vnni_int8", "amx_fp16")
LIBRARY_FOR_LEVEL = {"none": None, "avx2": "avx2", "avx512": "avx512", "avx512_vnni": "avx512_vnni",
                     "avx512_bf16": "avx512_bf16", "amx": "avx512_bf16"}
ENV_VAR = "KILN_ISA"
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class IsaChoice:
    detected: str  # the CPU's highest level
    level: str  # the level in use (detected, or lower when forced)
    forced: bool  # set by KILN_ISA
    flags: frozenset[str]  # the CPU's features that Kiln knows of

    @property
    def library(self) -> str | None:
        """The kernel build this level loads, or None (no build applies)."""
        return LIBRARY_FOR_LEVEL[self.level]

    def at_least(self, level: str) -> bool:
        return rank(self.level) >= rank(level)

    def describe(self) -> str:
        known = sorted(self.flags & (set().union(*LEVEL_FLAGS.values()) | set(EXTRA_FLAGS)))
        return (f"kiln kernels: ISA {self.level} (forced by {ENV_VAR}: {'yes' if self.forced else 'no'}; "
                f"CPU level {self.detected}; library {self.library or 'none'}; features {' '.join(known) or '-'})")


def rank(level: str) -> int:
    return LEVELS.index(level)


def parse_cpuinfo_flags(text: str) -> frozenset[str]:
    """The first `flags` line of /proc/cpuinfo text, as a set."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def level_of(flags: frozenset[str]) -> str:
    """The highest level all of whose features (and those below) are in flags."""
    level = "none"
    for candidate in LEVELS[1:]:
        if not LEVEL_FLAGS[candidate] <= flags:
            break
        level = candidate
    return level


def resolve(detected: str, requested: str | None) -> tuple[str, bool]:
    """(level to use, whether it was forced) from the CPU's level and KILN_ISA."""
    if requested is None or requested.strip() == "":
        return detected, False
    name = requested.strip().lower()
    if name not in LEVELS[1:]:
        raise ConfigError(f"{ENV_VAR} must be one of {', '.join(LEVELS[1:])}, got {requested!r}", param=ENV_VAR)
    if rank(name) > rank(detected):
        raise ConfigError(
            f"{ENV_VAR}={name} asks for more than this CPU has (its level is {detected}); "
            f"only a lower level can be forced", param=ENV_VAR,
        )
    return name, True


def read_cpu_flags() -> frozenset[str]:
    try:
        flags = parse_cpuinfo_flags(CPUINFO.read_text())
    except OSError:
        flags = frozenset()
    if flags:
        return flags
    # No /proc/cpuinfo (not Linux): torch's probe says AVX2 or AVX-512 only.
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return LEVEL_FLAGS["avx2"] | LEVEL_FLAGS["avx512"]
    return LEVEL_FLAGS["avx2"] if capability == "AVX2" else frozenset()


@functools.cache
def cpu_isa() -> IsaChoice:
    """The level in use in this process, decided (and logged) once."""
    flags = read_cpu_flags()
    detected = level_of(flags)
    level, forced = resolve(detected, os.environ.get(ENV_VAR))
    choice = IsaChoice(detected, level, forced, flags)
    log.info("%s", choice.describe())
    return choice


def preferred_cpu_dtype() -> str:
    """The model dtype `--dtype auto` should pick on this CPU: bfloat16 where
    it has AVX512_BF16 or AMX (native bf16 dot products), float32 elsewhere.
    Follows KILN_ISA, so a forced avx2 run behaves like an AVX2 machine."""
    return preferred_cpu_dtype_for(cpu_isa())


def preferred_cpu_dtype_for(choice: IsaChoice) -> str:
    return "bfloat16" if choice.at_least("avx512_bf16") else "float32"
