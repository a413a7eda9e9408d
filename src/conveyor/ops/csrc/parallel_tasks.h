// Two ways to hand a call's tasks to the threads instead of at::parallel_for's one fixed
// share per thread, which leaves the other threads waiting for the slowest (a thread runs
// slower on a core whose neighbour is busy, or when its tasks cost more):
// - parallel_tasks, for tasks of unequal cost: handed out from a shared counter in shrinking
//   runs (OpenMP's schedule(guided)). Decode attention over requests of different lengths
//   (fixed shares: one thread spinning at the end of the region, up to 9 % of a 13-request
//   decode step's samples; guided: such steps 1.06-1.12x faster, Zen 4) and causal prefill
//   attention. Each claim takes a quarter of a thread's share of what is left, so the last
//   runs are single tasks.
// - parallel_shares, for the matmuls' tasks of equal cost: each thread runs its own
//   contiguous share in order, which lets it prefetch its next task (guided, which interleaves
//   the threads' runs, measured up to 1.1x slower there), then takes tasks one at a time
//   from the end of the share with most left. Against fixed shares: the reference workload
//   1.03x on Zen 4 (docs/benchmarks.md).
// A task's work never depends on the thread that runs it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

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

// A share's tasks left, packed in one word so that its owner and a thief claim from it with
// one compare-and-swap: [first, end) as first | end << 32.
inline uint64_t first_of(uint64_t range) { return range & 0xffffffffu; }
inline uint64_t end_of(uint64_t range) { return range >> 32; }

// f(task, next) over [0, n) (n < 2^32), each task once: `next` is the task the thread
// expects to run after this one (-1 if none), for fetching ahead.
template <typename F>
void parallel_shares(int64_t n, F&& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) f(i, i + 1 < n ? i + 1 : -1);
    return;
  }
  struct alignas(64) Share {
    std::atomic<uint64_t> range;
  };
  std::vector<Share> shares(static_cast<size_t>(threads));
  for (int64_t s = 0; s < threads; ++s)
    shares[s].range.store(static_cast<uint64_t>(n * s / threads) |
                          static_cast<uint64_t>(n * (s + 1) / threads) << 32);
  at::parallel_for(0, threads, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {  // its own share, from the front
      std::atomic<uint64_t>& mine = shares[s].range;
      uint64_t r = mine.load(std::memory_order_relaxed);
      while (first_of(r) < end_of(r)) {
        if (!mine.compare_exchange_weak(r, r + 1, std::memory_order_relaxed)) continue;
        const auto task = static_cast<int64_t>(first_of(r));
        f(task, task + 1 < static_cast<int64_t>(end_of(r)) ? task + 1 : -1);
        r = mine.load(std::memory_order_relaxed);
      }
    }
    for (;;) {  // then others', from the back of the one with most left
      Share* most = nullptr;
      uint64_t seen = 0;  // its range when looked at
      for (Share& other : shares) {
        const uint64_t r = other.range.load(std::memory_order_relaxed);
        if (first_of(r) < end_of(r) &&
            (!most || end_of(r) - first_of(r) > end_of(seen) - first_of(seen)))
          most = &other, seen = r;
      }
      if (!most) return;
      const uint64_t first = first_of(seen), end = end_of(seen);
      if (!most->range.compare_exchange_weak(seen, first | (end - 1) << 32,
                                             std::memory_order_relaxed))
        continue;  // claimed meanwhile: look again
      const auto task = static_cast<int64_t>(end) - 1;
      f(task, task - 1 >= static_cast<int64_t>(first) ? task - 1 : -1);
    }
  });
}

}  // namespace conveyor
