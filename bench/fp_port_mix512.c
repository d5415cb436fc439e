// fp_port_mix.c's question for the AVX-512 builds: what a core charges for
// the sixteen-lane vector operations of Kiln's one-row kernels next to their
// FMAs (linear_f32.cpp's pair_micro: a pair of weight rows per vector; int4
// codes brought down by a shift and turned into floats by a table permute,
// dequantized by an FMA, one FMA with x; bf16 rows zero-extended and
// shifted; an fp16 KV pool converted), in registers, no memory traffic but
// loads from one cache line.
//
// Cycles are counted against "8 fma" taken as 4 (two 512-bit FMA pipes:
// Skylake-SP / Ice Lake Xeons with two FMA units, Zen 4 by halves); the
// first two rows tell whether the core has them: eight zmm FMAs as fast as
// eight ymm FMAs means two 512-bit pipes, twice as slow means one (then
// every figure below is half the real count). The wall time per "8 fma"
// iteration also gives the clock (two pipes: 4 cycles). Figures:
// docs/benchmarks.md ("On Ice Lake: what the one-row kernels' vectors cost").
//
//   gcc -O2 -o /tmp/fp_port_mix512 bench/fp_port_mix512.c && /tmp/fp_port_mix512
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#define ZERO "vzeroall"  // zeroes the whole of zmm0-15 too
#define FMA8_OF(r)                                                                         \
  "vfmadd231ps %%" r "14,%%" r "15,%%" r "0\n vfmadd231ps %%" r "14,%%" r "15,%%" r "1\n"   \
  "vfmadd231ps %%" r "14,%%" r "15,%%" r "2\n vfmadd231ps %%" r "14,%%" r "15,%%" r "3\n"   \
  "vfmadd231ps %%" r "14,%%" r "15,%%" r "4\n vfmadd231ps %%" r "14,%%" r "15,%%" r "5\n"   \
  "vfmadd231ps %%" r "14,%%" r "15,%%" r "6\n vfmadd231ps %%" r "14,%%" r "15,%%" r "7\n"
#define FMA8 FMA8_OF("zmm")
#include "fp_port_mix.h"

// Eight times OP with destination zmm8 + (i % 4): results unused, no chains.
#define X8(op) op "8\n" op "9\n" op "10\n" op "11\n" op "8\n" op "9\n" op "10\n" op "11\n"
#define SHIFT "vpsrld $4,%%zmm12,%%zmm"
#define PERMUTE "vpermps %%zmm13,%%zmm12,%%zmm"
#define SHUFFLE "vpshufb %%zmm13,%%zmm12,%%zmm"
#define CVTPH "vcvtph2ps %%ymm12,%%zmm"
#define ZEXT "vpmovzxwd %%ymm12,%%zmm"
#define BCAST "vbroadcastf32x8 (%0),%%zmm"

// One pair vector of the int4 one-row pass (two weight rows, eight codes each):
// code words zmm12, table 0..15 zmm13, scale zmm15, min zmm14, x zmm11;
// accumulator zmm<acc> (zmm0-7), temporary zmm<t>. The shift (or shuffle) puts the code
// in the low four bits of zmm<t>'s lanes.
#define INT4_TAIL(acc, t)                                                                    \
  "vpermps %%zmm13,%%zmm" t ",%%zmm" t "\n vfmadd213ps %%zmm14,%%zmm15,%%zmm" t "\n"          \
  "vfmadd231ps %%zmm11,%%zmm" t ",%%zmm" acc "\n"
#define INT4_SHIFT(acc, t) "vpsrld $4,%%zmm12,%%zmm" t "\n" INT4_TAIL(acc, t)
#define INT4_SHUFFLE(acc, t) "vpshufb %%zmm13,%%zmm12,%%zmm" t "\n" INT4_TAIL(acc, t)
#define INT4_NOSHIFT(acc, t) "vmovaps %%zmm12,%%zmm" t "\n" INT4_TAIL(acc, t)
// The table-free widening: mask, convert (the avx2 build's and the panels' way).
#define INT4_MASK(acc, t)                                                                    \
  "vpsrld $4,%%zmm12,%%zmm" t "\n vpandd %%zmm13,%%zmm" t ",%%zmm" t "\n"                     \
  "vcvtdq2ps %%zmm" t ",%%zmm" t "\n vfmadd213ps %%zmm14,%%zmm15,%%zmm" t "\n"                \
  "vfmadd231ps %%zmm11,%%zmm" t ",%%zmm" acc "\n"
// A bf16 pair vector: sixteen bf16 zero-extended and shifted into floats, one FMA.
#define BF16_VEC(acc, t)                                                                     \
  "vpmovzxwd %%ymm12,%%zmm" t "\n vpslld $16,%%zmm" t ",%%zmm" t "\n"                         \
  "vfmadd231ps %%zmm11,%%zmm" t ",%%zmm" acc "\n"
// Sixteen fp16 keys or values of the KV pool converted, one FMA.
#define FP16_VEC(acc, t) "vcvtph2ps %%ymm12,%%zmm" t "\n vfmadd231ps %%zmm11,%%zmm" t ",%%zmm" acc "\n"
#define EIGHT(V) V("0", "8") V("1", "9") V("2", "10") V("3", "8") V("4", "9") V("5", "10") V("6", "8") V("7", "9")

int main(void) {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) {
    printf("this CPU has no AVX-512 F/BW: nothing to measure (bench/fp_port_mix.c covers AVX2)\n");
    return 0;
  }
  double ymm = 1e9, zmm = 1e9;
  for (int pass = 0; pass < 5; ++pass) {
    const double y = PASS(FMA8_OF("ymm")), z = PASS(FMA8);
    ymm = y < ymm ? y : ymm;
    zmm = z < zmm ? z : zmm;
  }
  printf("8 zmm fma %.2f ns, 8 ymm fma %.2f ns: %s 512-bit FMA pipe(s); clock %.2f GHz if two\n", zmm * 1e9,
         ymm * 1e9, zmm < 1.5 * ymm ? "two" : "one", 4.0 / zmm / 1e9);
  const struct { const char* name; double cycles; int vectors; } rows[] = {
      {"8 fma", CYCLES(FMA8), 0},
      {"8 fma + 8 shift (vpsrld)", CYCLES(FMA8 X8(SHIFT)), 0},
      {"8 fma + 8 permute (vpermps)", CYCLES(FMA8 X8(PERMUTE)), 0},
      {"8 fma + 8 byte shuffle (vpshufb)", CYCLES(FMA8 X8(SHUFFLE)), 0},
      {"8 fma + 8 fp16 convert (vcvtph2ps)", CYCLES(FMA8 X8(CVTPH)), 0},
      {"8 fma + 8 zero-extend (vpmovzxwd)", CYCLES(FMA8 X8(ZEXT)), 0},
      {"8 fma + 8 broadcast (vbroadcastf32x8 m256)", CYCLES(FMA8 X8(BCAST)), 0},
      {"int4 pair x8: shift, permute, fma, fma", CYCLES(EIGHT(INT4_SHIFT)), 8},
      {"int4 pair x8: shuffle, permute, fma, fma", CYCLES(EIGHT(INT4_SHUFFLE)), 8},
      {"int4 pair x8: permute, fma, fma (code 0)", CYCLES(EIGHT(INT4_NOSHIFT)), 8},
      {"int4 x8: shift, and, convert, fma, fma", CYCLES(EIGHT(INT4_MASK)), 8},
      {"bf16 pair x8: zero-extend, shift, fma", CYCLES(EIGHT(BF16_VEC)), 8},
      {"fp16 x8: convert, fma", CYCLES(EIGHT(FP16_VEC)), 8},
  };
  printf("cycles per iteration, counted against '8 fma' = 4 (2 FMAs per cycle)\n");
  for (unsigned i = 0; i < sizeof rows / sizeof rows[0]; ++i) {
    printf("%-48s %5.2f", rows[i].name, rows[i].cycles);
    if (rows[i].vectors) printf("   (%.2f per vector of 16 weights)", rows[i].cycles / rows[i].vectors);
    printf("\n");
  }
  return 0;
}
