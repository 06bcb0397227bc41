// Results of the searches: sort keys decoded into (score, row), and padding written with streaming stores.
#pragma once

#include "tensor.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "constants.h"
#include "topk_state.h"

namespace silverrec {

// One sort key -> (score, row): float(score) * mul + add, one rounding per operation; padding -> (-inf, kNoRow).
inline void decode_key(int64_t key, float mul, float add, float& score, int64_t& row) {
  if (key == kEmptyKey) {
    score = -std::numeric_limits<float>::infinity();
    row = kNoRow;
  } else {
    const float prod = float(key >> 32) * mul;
    score = prod + add;
    row = key_row(key);
  }
}

// Sort keys int64 [B, k] -> (scores float32, rows int64) [B, k], exactly like kernels/common.py split_keys +
// dequantize_scores: float(score) * (sc * qs[b]) + of * qm[b] with one rounding per operation (built with
// -ffp-contract=off: no FMA); padding -> (-inf, kNoRow).
inline std::tuple<at::Tensor, at::Tensor> decode_keys(const at::Tensor& keys, const float* qs, const float* qm, float sc,
                                                      float of) {
  const int64_t B = keys.size(0), k = keys.size(1);
  at::Tensor scores = at::empty({B, k}, at::kFloat), rows = at::empty({B, k}, at::kLong);
  const int64_t* kp = keys.data_ptr<int64_t>();
  float* sp = scores.data_ptr<float>();
  int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const float mul = sc * qs[b], add = of * qm[b];
    for (int64_t i = b * k; i < (b + 1) * k; ++i) decode_key(kp[i], mul, add, sp[i], rp[i]);
  }
  return {scores, rows};
}

// The padding of a large result (k 4096 over a few hundred matches: 768 KB per batch of 16, most of it
// padding) written with streaming stores: no read of each line before it is written, and the caches keep
// the search's own data. Short fills use ordinary stores; callers fence (streaming_done) after their fills.
constexpr int64_t kStreamingMinBytes = 4096;
template <typename T>
void fill_streaming(T* p, int64_t n, T v) {
#if defined(__AVX512F__)
  if (n * int64_t(sizeof(T)) >= kStreamingMinBytes) {
    constexpr int64_t kPerLine = 64 / sizeof(T);
    for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 63); --n) *p++ = v;  // to a line boundary
    T line[kPerLine];
    std::fill(line, line + kPerLine, v);
    const __m512i w = _mm512_loadu_si512(line);
    for (; n >= kPerLine; n -= kPerLine, p += kPerLine) _mm512_stream_si512(reinterpret_cast<__m512i*>(p), w);
  }
#endif
  std::fill(p, p + n, v);
}

inline void streaming_done() {
#if defined(__AVX512F__)
  _mm_sfence();
#endif
}

}  // namespace silverrec
