// Token passes of the matmul kernels: m rows cut into the fewest passes of at most `most`
// rows, all of (nearly) the same length. The kernels split (pass x output tile) tasks evenly
// over the threads, so tasks must cost the same: with passes of exactly `most` rows a short
// last one left a thread idle (144 rows in passes of 64, 64 and 16 ran the 2-thread float32
// matmuls 1.5x slower than 128 rows). A row's operations never depend on its pass.
#pragma once

#include <algorithm>
#include <cstdint>

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

}  // namespace conveyor
