// Work shared between threads by claims instead of fixed shares.
//
// at::parallel_for gives each thread an equal share up front, so a step's
// slowest thread sets its time: a worker that wakes late from its sleep
// between calls, or a vCPU the host takes away for a while, leaves the other
// thread waiting at the join (an offline run's py-spy profile on Ice Lake:
// the calling thread in libgomp's fork and join around linear_w4 ~7% of its
// samples).
// guided_for hands out [0, n) in chunks the threads claim in turn: each
// claim takes a share of what is left (half of it split between the
// threads, so the first chunks are long and the last ones `grain`), and a
// thread that runs behind simply claims fewer. Which thread computes which
// rows changes no bits: every caller computes an output by the same chain
// whatever its chunk.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kiln_parallel {

// Chunk boundaries are multiples of `grain` from 0 (the last chunk ends at n).
// make_worker() runs once on each thread and returns work(begin, end), called
// for each chunk that thread claims: per-thread buffers live in the worker.
template <typename MakeWorker>
void guided_for(int64_t n, int64_t grain, const MakeWorker& make_worker) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) {
    make_worker()(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto work = make_worker();
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < n) {
      const int64_t share = std::max<int64_t>(1, (n - begin) / (2 * threads * grain)) * grain;
      const int64_t end = std::min(n, begin + share);
      // On failure `begin` is reloaded with the counter's value.
      if (next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) {
        work(begin, end);
        begin = next.load(std::memory_order_relaxed);
      }
    }
  });
}

}  // namespace kiln_parallel
