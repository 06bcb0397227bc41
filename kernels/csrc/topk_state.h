// Running top-k of int64 sort keys for one query in one worker thread (see scan.cpp).
//
//   key = score * 2**32 + (2**32 - 1 - row)     (kernels/common.py `make_keys`)
//
// Keys of one query are distinct (a row is visited once per query), so "beats the k-th best key"
// is a strict comparison and the surviving set after any compaction is exact.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace silverrec {

constexpr int64_t kEmptyKey = std::numeric_limits<int64_t>::min();  // padding: sorts after every item

inline int64_t make_key(int32_t score, int64_t row) {
  return int64_t(score) * (int64_t{1} << 32) + (int64_t{0xFFFFFFFF} - row);
}

struct TopK {
  std::vector<int64_t> buf;  // [cap] candidate keys; the first n are live
  int64_t n = 0, k = 0, cap = 0;
  int64_t thr_key = kEmptyKey;  // k-th best key seen so far (kEmptyKey until the first compaction)
  int32_t thr_score = std::numeric_limits<int32_t>::min();  // thr_key >> 32: scores below it never enter

  // Buffer of about 2k keys (at least k + 1024): a compaction (nth_element, O(cap)) every
  // cap - k pushes keeps the amortised cost per push O(1) and the threshold tight.
  void ensure(int64_t k_) {
    if (cap) return;
    k = k_;
    cap = k + std::max<int64_t>(k, 1024);
    buf.resize(cap);
  }

  // Offer (score, row); callers pre-filter on score >= thr_score (cheap int32 compare).
  inline void offer(int32_t score, int64_t row) {
    const int64_t key = make_key(score, row);
    if (key > thr_key) {
      buf[n++] = key;
      if (n == cap) compact();
    }
  }

  // Keep the k best keys; the k-th becomes the threshold.
  void compact() {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.begin() + n, std::greater<int64_t>());
    n = k;
    thr_key = buf[k - 1];
    thr_score = int32_t(thr_key >> 32);
  }
};

}  // namespace silverrec
