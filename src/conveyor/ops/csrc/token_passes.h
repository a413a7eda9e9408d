// Token passes of the matmul kernels, and their tasks (a pass against a run of output groups).
// TokenPasses: m rows cut into the fewest passes of at most `most` rows, all of (nearly) the
// same length. The kernels split (pass x output tile) tasks evenly over the threads, so tasks
// must cost the same: with passes of exactly `most` rows a short last one left a thread idle
// (144 rows in passes of 64, 64 and 16 ran the 2-thread float32 matmuls 1.5x slower than 128
// rows). A row's operations never depend on its pass.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel_tasks.h"

namespace conveyor {

struct TokenPasses {
  int64_t count;  // passes
  int64_t len;    // rows of every pass but possibly the last (which is at most this long)

  // `align` (dividing `most`): every pass but the last starts and ends at a multiple of it.
  TokenPasses(int64_t m, int64_t most, int64_t align = 1)
      : count((m + most - 1) / most),
        len(count ? ((m + count - 1) / count + align - 1) / align * align : 0) {}
  int64_t begin(int64_t pass) const { return pass * len; }
  int64_t end(int64_t pass, int64_t m) const { return std::min(m, (pass + 1) * len); }
};

// A matmul task: token rows [m0, m1) (one pass) against output groups [first, first + here),
// at most Per; group[j] is where group first + j's weights start, or zeros past the last
// group, so that a kernel may always run Per groups.
template <class T, int64_t Per>
struct GroupTask {
  const T* group[Per];
  int64_t first, here, m0, m1;
};

// f(task, next) for every task of a matmul of m rows (`passes`) and `groups` output groups
// (`group_size` elements of w apart), `per` (<= Per) groups a task, pass-major so that a
// thread's run of tasks shares x's rows, over the threads by parallel_shares; `next`: the
// first group of the task the thread expects to run next (for fetching ahead), or -1.
template <class T, int64_t Per, class F>
void for_each_group_task(const T* w, int64_t group_size, int64_t groups, int64_t per,
                         const TokenPasses& passes, int64_t m, F&& f) {
  const int64_t tasks = (groups + per - 1) / per;
  // What the last task's pointers past the last group point at (a group of zeros).
  const std::vector<T> zero_group(static_cast<size_t>(groups % per ? group_size : 0));
  const T* zeros = zero_group.data();
  parallel_shares(passes.count * tasks, [&](int64_t task, int64_t next) {
    const int64_t pass = task / tasks, first = (task % tasks) * per;
    GroupTask<T, Per> t{{}, first, std::min(per, groups - first), passes.begin(pass),
                        passes.end(pass, m)};
    for (int64_t j = 0; j < Per; ++j)
      t.group[j] = j < t.here ? w + (first + j) * group_size : zeros;
    f(t, next >= 0 ? (next % tasks) * per : -1);
  });
}

}  // namespace conveyor
