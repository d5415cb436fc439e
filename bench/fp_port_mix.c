// What an AVX2 core charges for the vector operations of Kiln's batch-1
// weight-only decode kernels (linear_f32.cpp: int4 codes widened with a shift,
// a mask and a convert, dequantized with an FMA, then one FMA per 8 weights of
// the dot product; int8 codes sign-extended, converted, one FMA), measured
// in registers, with no memory traffic but broadcasts and 8-byte loads from
// one cache line.
//
// The FMAs of a loop body update eight accumulator chains, so their 4-cycle
// latency allows 4 cycles per iteration, what two FMA pipes take for eight.
// Cycles are counted against the first loop (8 FMAs: 4 cycles on a core with
// two 256-bit FMA pipes, Zen 2 and later, Intel since Haswell; not Zen 1), so
// no clock frequency has to be known. A mix that costs no more than "8 fma"
// runs in pipes the FMAs leave free. docs/benchmarks.md ("Why the int4 and
// int8 one-row kernels stay compute-bound on Zen 3") has the figures.
//
//   gcc -O2 -o /tmp/fp_port_mix bench/fp_port_mix.c && /tmp/fp_port_mix
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define ZERO "vzeroall"
#define FMA8 \
  "vfmadd231ps %%ymm14,%%ymm15,%%ymm0\n vfmadd231ps %%ymm14,%%ymm15,%%ymm1\n"   \
  "vfmadd231ps %%ymm14,%%ymm15,%%ymm2\n vfmadd231ps %%ymm14,%%ymm15,%%ymm3\n"   \
  "vfmadd231ps %%ymm14,%%ymm15,%%ymm4\n vfmadd231ps %%ymm14,%%ymm15,%%ymm5\n"   \
  "vfmadd231ps %%ymm14,%%ymm15,%%ymm6\n vfmadd231ps %%ymm14,%%ymm15,%%ymm7\n"
#include "fp_port_mix.h"

// Eight times OP with destination ymm8 + (i % 4): results unused, no chains.
#define X8(op) op "8\n" op "9\n" op "10\n" op "11\n" op "8\n" op "9\n" op "10\n" op "11\n"
#define SHIFT "vpsrld $4,%%ymm12,%%ymm"
#define CVT "vcvtdq2ps %%ymm12,%%ymm"
#define AND "vpand %%ymm13,%%ymm12,%%ymm"
#define PMOVSX "vpmovsxbd (%0),%%ymm"
#define BCAST "vbroadcastss 4(%0),%%ymm"

// One int4 vector of the decode kernel: code word ymm12, mask ymm13, scale
// ymm15, min ymm14, x ymm11; accumulator ymm<acc> (ymm0-7), temporary ymm<t>.
// Convert the masked code in ymm<t>, dequantize it, add its product with x to ymm<acc>.
#define INT4_TAIL(acc, t)                                                                       \
  "vcvtdq2ps %%ymm" t ",%%ymm" t "\n vfmadd213ps %%ymm14,%%ymm15,%%ymm" t "\n"                  \
  "vfmadd231ps %%ymm11,%%ymm" t ",%%ymm" acc "\n"
#define INT4_VEC(acc, t) \
  "vpsrld $4,%%ymm12,%%ymm" t "\n vpand %%ymm13,%%ymm" t ",%%ymm" t "\n" INT4_TAIL(acc, t)
#define INT4_VEC_NOSHIFT(acc, t) "vpand %%ymm13,%%ymm12,%%ymm" t "\n" INT4_TAIL(acc, t)
#define INT8_VEC(acc, t)                                                                        \
  "vpmovsxbd (%0),%%ymm" t "\n vcvtdq2ps %%ymm" t ",%%ymm" t "\n"                                \
  "vfmadd231ps %%ymm11,%%ymm" t ",%%ymm" acc "\n"
#define EIGHT(V) V("0", "8") V("1", "9") V("2", "10") V("3", "8") V("4", "9") V("5", "10") V("6", "8") V("7", "9")

int main(void) {
  const struct { const char* name; double cycles; int vectors; } rows[] = {
      {"8 fma", CYCLES(FMA8), 0},
      {"8 fma + 8 shift (vpsrld)", CYCLES(FMA8 X8(SHIFT)), 0},
      {"8 fma + 8 convert (vcvtdq2ps)", CYCLES(FMA8 X8(CVT)), 0},
      {"8 fma + 8 and (vpand)", CYCLES(FMA8 X8(AND)), 0},
      {"8 fma + 8 sign-extend (vpmovsxbd m64)", CYCLES(FMA8 X8(PMOVSX)), 0},
      {"8 fma + 8 broadcast (vbroadcastss m32)", CYCLES(FMA8 X8(BCAST)), 0},
      {"8 shift + 8 convert", CYCLES(X8(SHIFT) X8(CVT)), 0},
      {"int4 vector x8: shift, and, convert, fma, fma", CYCLES(EIGHT(INT4_VEC)), 8},
      {"int4 vector x8 without the shift", CYCLES(EIGHT(INT4_VEC_NOSHIFT)), 8},
      {"int8 vector x8: sign-extend, convert, fma", CYCLES(EIGHT(INT8_VEC)), 8},
  };
  printf("cycles per iteration, counted against '8 fma' = 4 (2 FMAs per cycle)\n");
  for (unsigned i = 0; i < sizeof rows / sizeof rows[0]; ++i) {
    printf("%-48s %5.2f", rows[i].name, rows[i].cycles);
    if (rows[i].vectors) printf("   (%.2f per vector of 8 weights)", rows[i].cycles / rows[i].vectors);
    printf("\n");
  }
  return 0;
}
