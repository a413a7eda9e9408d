// Tasks handed out from a shared counter in shrinking runs (OpenMP's schedule(guided)),
// instead of at::parallel_for's one fixed share per thread, for tasks of unequal cost: decode
// attention over requests of different lengths (fixed shares: one thread spinning at the
// end of the region, up to 9 % of a 13-request decode step's samples; guided: such steps
// 1.06-1.12x faster, Zen 4) and causal prefill attention. Each claim takes a quarter of a
// thread's share of what is left, so the last runs are single tasks. The matmuls keep fixed
// shares: their tasks cost the same, and a thread's contiguous share lets it prefetch its
// next task (guided measured up to 1.1x slower there). A task's work never depends on the
// thread that runs it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace conveyor {

// f(begin, end) over consecutive runs of [0, n), each run on one thread.
template <typename F>
void parallel_tasks(int64_t n, F&& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < n) {
      const int64_t run = std::max<int64_t>(1, (n - begin) / (4 * threads));
      if (next.compare_exchange_weak(begin, begin + run, std::memory_order_relaxed)) {
        f(begin, std::min(n, begin + run));
        begin = next.load(std::memory_order_relaxed);
      }
    }
  });
}

}  // namespace conveyor
