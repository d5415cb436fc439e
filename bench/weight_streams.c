// How fast one thread reads int8 weight rows [N, K] from DRAM in the access
// orders of Kiln's one-row (decode) linear kernels, with no arithmetic beyond a
// byte add per 32 bytes: the rows one at a time (a single sequential stream),
// NR rows side by side (what the micro-kernels do, for enough FMA chains), and
// NR rows side by side with the next pass's rows requested either as the same
// line of each row (NR streams: Kiln before 2026-12-05) or as one linear run
// (kiln_linear::prefetch_ahead). Prints GB/s per order, three rounds.
//
//   gcc -O3 -mavx2 -o /tmp/weight_streams bench/weight_streams.c && /tmp/weight_streams [K]
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

enum Prefetch { kNone, kSameLine, kLinear };

// Rows [n0, n0 + nr) read side by side, 32 bytes of each per step.
static long read_rows(const int8_t* w, long n_rows, long K, int nr, enum Prefetch prefetch) {
  __m256i sum = _mm256_setzero_si256();
  for (long n0 = 0; n0 + nr <= n_rows; n0 += nr) {
    const int8_t* rows = w + n0 * K;
    for (long k = 0; k + 32 <= K; k += 32) {
      if (prefetch != kNone && k % 64 == 0)
        for (int j = 0; j < nr; ++j) {
          const char* line = prefetch == kSameLine ? (const char*)(rows + (nr + j) * K + k)
                                                   : (const char*)rows + nr * K + nr * k + 64 * j;
          _mm_prefetch(line, _MM_HINT_T0);
        }
      for (int j = 0; j < nr; ++j) sum = _mm256_add_epi8(sum, _mm256_loadu_si256((const __m256i*)(rows + j * K + k)));
    }
  }
  return _mm256_extract_epi64(sum, 0);
}

int main(int argc, char** argv) {
  const long K = argc > 1 ? atol(argv[1]) : 576, bytes = 256L << 20, n_rows = bytes / K / 8 * 8;
  int8_t* w = aligned_alloc(64, bytes + (1 << 22));
  memset(w, 1, bytes + (1 << 22));
  const struct { const char* name; int nr; enum Prefetch prefetch; } orders[] = {
      {"1 row, next row prefetched", 1, kSameLine},
      {"4 rows, no prefetch", 4, kNone},
      {"4 rows, same line of the next 4", 4, kSameLine},
      {"4 rows, next 4 as one linear run", 4, kLinear},
      {"8 rows, same line of the next 8", 8, kSameLine},
      {"8 rows, next 8 as one linear run", 8, kLinear},
  };
  long check = 0;
  printf("K = %ld, %ld MiB of rows, one thread\n", K, bytes >> 20);
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < sizeof orders / sizeof orders[0]; ++i) {
      const double t = now();
      check += read_rows(w, n_rows, K, orders[i].nr, orders[i].prefetch);
      printf("  %-34s %5.1f GB/s\n", orders[i].name, n_rows * K / (now() - t) / 1e9);
    }
    printf("\n");
  }
  fprintf(stderr, "(checksum %ld)\n", check);  // keeps the reads
  return 0;
}
