// RowCounts: a small open-addressing map row -> count, sized by the rows a request holds (never by
// the pool), shared by the retrieval tail (candidates.cpp) and the request encoding (encode.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace silverrec {

// Rows (int64 >= 0) with a count each, open addressing: sized for `n` distinct rows, so that a
// request's work never depends on the pool's size (a [N] table per request would, at 10M rows).
class RowCounts {
 public:
  explicit RowCounts(int64_t n) {
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    keys_.assign(cap, -1);
    counts_.assign(cap, 0);
    mask_ = uint64_t(cap - 1);
  }
  // The row's count, inserted at 0 when absent.
  int32_t& at(int64_t row) {
    uint64_t i = slot(row);
    while (keys_[i] != row && keys_[i] != -1) i = (i + 1) & mask_;
    keys_[i] = row;
    return counts_[i];
  }
  int32_t get(int64_t row) const {
    uint64_t i = slot(row);
    while (keys_[i] != -1) {
      if (keys_[i] == row) return counts_[i];
      i = (i + 1) & mask_;
    }
    return 0;
  }

 private:
  uint64_t slot(int64_t row) const { return (uint64_t(row) * 0x9E3779B97F4A7C15ull >> 17) & mask_; }
  std::vector<int64_t> keys_;
  std::vector<int32_t> counts_;
  uint64_t mask_ = 0;
};

}  // namespace silverrec
