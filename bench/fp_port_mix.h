// The timing shared by bench/fp_port_mix.c (AVX2) and bench/fp_port_mix512.c
// (AVX-512): register-only loops of inline assembly. A file defines CLOBBERS
// (the vector registers its loops write), ZERO (assembly that zeroes them:
// whatever the compiler left there could be denormal floats, which some CPUs
// take slow paths for) and FMA8 (eight FMAs on eight accumulator chains, whose
// 4-cycle latency allows 4 cycles an iteration, what two FMA pipes take for
// eight), then includes this.
#include <stdio.h>
#include <time.h>

static char line[64] __attribute__((aligned(64)));
static const long kIters = 10000000;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// One timed pass of `body`: seconds per iteration.
#define PASS(body)                                                                   \
  ({                                                                                 \
    __asm__ volatile(ZERO ::: CLOBBERS);                                             \
    const double t0 = now();                                                         \
    for (long i = 0; i < kIters; ++i) __asm__ volatile(body ::"r"(line) : CLOBBERS); \
    (now() - t0) / kIters;                                                           \
  })

// Cycles per iteration of `body`: five passes alternated with passes of the
// 8-FMA loop, the best of each (another process or a frequency change only
// ever slows a pass), `body`'s best over the FMA loop's times 4.
#define CYCLES(body)                               \
  ({                                               \
    double best = 1e9, fma_best = 1e9;             \
    for (int pass = 0; pass < 5; ++pass) {         \
      const double f = PASS(FMA8), t = PASS(body); \
      fma_best = f < fma_best ? f : fma_best;      \
      best = t < best ? t : best;                  \
    }                                              \
    4.0 * best / fma_best;                         \
  })
