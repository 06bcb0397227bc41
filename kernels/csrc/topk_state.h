// Running top-k of int64 sort keys for one query in one worker thread (see scan.cpp).
//
//   key = score * 2**32 + (2**32 - 1 - row)     (kernels/common.py `make_keys`)
//
// Keys of one query are distinct (a row is visited once per query), so "beats the k-th best key"
// is a strict comparison and the surviving set after any compaction is exact.
#pragma once

#include <algorithm>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cstring>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <vector>

#include "constants.h"  // kEmptyKey: padding, sorts after every item

namespace silverrec {


inline int64_t make_key(int32_t score, int64_t row) {
  return int64_t(score) * (int64_t{1} << 32) + (int64_t{0xFFFFFFFF} - row);
}

// The row (or position) a key carries: make_key's inverse for its low half.
inline int64_t key_row(int64_t key) { return int64_t{0xFFFFFFFF} - (key & int64_t{0xFFFFFFFF}); }

// A monotone int32 image of a float that is not NaN (-0 as +0, so that equal floats give equal images):
// float scores as make_key's score (float_rank.cpp, centroid_probe.cpp).
inline int32_t ordered_bits(float s) {
  s += 0.0f;
  int32_t i;
  std::memcpy(&i, &s, sizeof(i));
  return i >= 0 ? i : int32_t(i ^ 0x7FFFFFFF);
}

#if !defined(__AVX512F__) && defined(__AVX2__)
// AVX2 has no compress store: vpermd tables that move the 64-bit lanes of a 4-bit mask to the front
// (>= pivot) or to the back (< pivot) of a 4-lane vector.
struct CompressLut {
  alignas(32) int32_t front[16][8];
  alignas(32) int32_t back[16][8];
  CompressLut() {
    for (int mk = 0; mk < 16; ++mk) {
      const int cnt = __builtin_popcount(mk);
      int f = 0, b = 4 - cnt;
      for (int j = 0; j < 4; ++j) {
        if (!(mk >> j & 1)) continue;
        front[mk][2 * f] = 2 * j, front[mk][2 * f + 1] = 2 * j + 1, ++f;
        back[mk][2 * b] = 2 * j, back[mk][2 * b + 1] = 2 * j + 1, ++b;
      }
      for (; f < 4; ++f) front[mk][2 * f] = front[mk][2 * f + 1] = 0;  // don't-care lanes
      for (int j = 0; j < 4 - cnt; ++j) back[mk][2 * j] = back[mk][2 * j + 1] = 0;
    }
  }
};
inline const CompressLut& compress_lut() {
  static const CompressLut lut;
  return lut;
}
#endif

// Move the k largest of n distinct keys to a[0, k) (unordered). Quickselect whose partition step
// is branch-free (AVX-512 compresses: 8 keys per step; AVX2: vpermd tables, 4 keys) into
// scratch `tmp` (2n + 16 entries); pivot = median of three, partition into >= pivot / < pivot (the median is never the minimum, so
// every step shrinks the range). Short ranges finish with std::nth_element.
inline void select_top(int64_t* a, int64_t n, int64_t k, std::vector<int64_t>& tmp) {
  if (k >= n) return;
  if (tmp.size() < size_t(2 * n + 16)) tmp.resize(2 * n + 16);
  int64_t lo = 0, hi = n;  // a[0, lo) are in the top k; the k-th largest lies in a[lo, hi)
  while (hi - lo > 64) {
    int64_t* p = a + lo;
    const int64_t m = hi - lo;
    const int64_t x = p[0], y = p[m / 2], z = p[m - 1];
    const int64_t pivot = std::max(std::min(x, y), std::min(std::max(x, y), z));
    int64_t *ge = tmp.data(), *lt = tmp.data() + m;  // >= pivot from the front, < pivot from the back
    int64_t i = 0;
#if defined(__AVX512F__)
    // each side compressed in a register and stored whole (the lanes past its count are overwritten by
    // the next store): a compress straight to memory is microcoded on AMD Zen 4, several times slower. The < lanes run forward from tmp + m + 8,
    // then move to end at tmp + m.
    int64_t* const lo_start = tmp.data() + m + 8;
    int64_t* lo_run = lo_start;
    const __m512i pv = _mm512_set1_epi64(pivot);
    for (; i + 8 <= m; i += 8) {
      const __m512i v = _mm512_loadu_si512(p + i);
      const __mmask8 up = _mm512_cmpge_epi64_mask(v, pv);
      const int nu = __builtin_popcount(up);
      _mm512_storeu_si512(ge, _mm512_maskz_compress_epi64(up, v));
      _mm512_storeu_si512(lo_run, _mm512_maskz_compress_epi64(__mmask8(~up), v));
      ge += nu;
      lo_run += 8 - nu;
    }
    lt -= lo_run - lo_start;
    std::memcpy(lt, lo_start, (lo_run - lo_start) * sizeof(int64_t));
#elif defined(__AVX2__)
    // 4 keys per step: the >= lanes stored at ge (front-packed), the < lanes ending at lt
    // (back-packed); 8 free slots between them keep the two 4-lane stores from clobbering data
    const CompressLut& lut = compress_lut();
    const __m256i pv = _mm256_set1_epi64x(pivot);
    for (; i + 8 <= m; i += 4) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
      const int up = ~_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(pv, v))) & 0xF;
      const int nu = __builtin_popcount(up);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ge), _mm256_permutevar8x32_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(lut.front[up]))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lt - 4), _mm256_permutevar8x32_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(lut.back[~up & 0xF]))));
      ge += nu;
      lt -= 4 - nu;
    }
#endif
    for (; i < m; ++i) {
      if (p[i] >= pivot) *ge++ = p[i];
      else *--lt = p[i];
    }
    const int64_t n_ge = ge - tmp.data();
    std::memcpy(p, tmp.data(), n_ge * sizeof(int64_t));
    std::memcpy(p + n_ge, lt, (m - n_ge) * sizeof(int64_t));
    if (lo + n_ge <= k) lo += n_ge;  // all of them are in the top k
    else hi = lo + n_ge;             // the top k ends inside them
    if (lo == k) return;
  }
  std::nth_element(a + lo, a + (k - 1), a + hi, std::greater<int64_t>());
}

// Recycled key buffers: large vectors freed back to the OS cost page faults on every call, so
// they are kept (up to a bound) for the next scan.
struct KeyPool {
  static void take(std::vector<int64_t>& v, int64_t n) {
    {
      std::lock_guard<std::mutex> g(mu());
      auto& p = pool();
      if (!p.empty()) {
        v.swap(p.back());
        p.pop_back();
      }
    }
    if (int64_t(v.capacity()) < n) v.reserve(n);
    v.resize(n);  // no-op fill when recycled at the same size
  }
  static void give(std::vector<int64_t>& v) {
    if (v.capacity() == 0) return;
    std::lock_guard<std::mutex> g(mu());
    auto& p = pool();
    if (p.size() < 256) {
      p.emplace_back();
      p.back().swap(v);
    }
  }

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::vector<int64_t>>& pool() {
    static std::vector<std::vector<int64_t>> p;
    return p;
  }
};

struct TopK {
  std::vector<int64_t> buf;      // [cap] candidate keys; the first n are live (recycled, see KeyPool)
  std::vector<int64_t> scratch;  // select_top scratch
  int64_t n = 0, k = 0, cap = 0;
  int64_t thr_key = kEmptyKey;  // k-th best key seen so far (kEmptyKey until the first compaction)
  int32_t thr_score = std::numeric_limits<int32_t>::min();  // thr_key >> 32: scores below it never enter

  // Buffer of about 2k keys (at least k + 256): a compaction (select_top, O(cap)) every cap - k pushes
  // keeps the amortised cost per push O(1) and the threshold tight. k + 1024 let a k 100 scan offer
  // ~1,100 rows per query before its first real threshold, which measured slower than this size.
  void ensure(int64_t k_) {
    if (cap) return;
    k = k_;
    cap = k + std::max<int64_t>(k, 256);
    KeyPool::take(buf, cap);
  }

  ~TopK() {
    KeyPool::give(buf);
    KeyPool::give(scratch);
  }

  // Offer (score, row); callers pre-filter on score >= thr_score (cheap int32 compare).
  __attribute__((always_inline)) inline void offer(int32_t score, int64_t row) {
    const int64_t key = make_key(score, row);
    if (key > thr_key) {
      buf[n++] = key;
      if (n == cap) compact();
      else if (n == k && thr_key == kEmptyKey) first_threshold();
    }
  }

  // The first k keys: their minimum is already a valid threshold (no compaction needed).
  __attribute__((noinline)) void first_threshold() {
    thr_key = *std::min_element(buf.begin(), buf.begin() + n);
    thr_score = int32_t(thr_key >> 32);
  }

  // Keep the k best keys; the smallest of them becomes the threshold.
  __attribute__((noinline)) void compact() {
    select_top(buf.data(), n, k, scratch);
    n = k;
    thr_key = *std::min_element(buf.begin(), buf.begin() + k);
    thr_score = int32_t(thr_key >> 32);
  }
};

}  // namespace silverrec

namespace silverrec {

// Sort int64 keys descending: LSD radix sort on the bits that vary (bits equal in every key -- high
// score bits, high row bits -- are neither counted nor passed over), std::sort up to kComparisonSortMax
// keys. A digit is 8 bits, 11 from kWideDigitMin keys: each digit starts at the next varying bit, so a
// search's keys in row order (score bits alone) take 2 passes of 11 bits instead of 3 bytes. The radix
// sort has no data-dependent branches; std::sort's comparisons mispredict on a search's keys (a fresh
// order every call), so the filtered search op at k 240-4096 is faster with the radix sort. At k 100 the
// keys come out of select_top's partitions, partly ordered, and std::sort is as fast on one query batch
// repeated; over varied batches (fresh branch histories, as in serving) the radix sort from 16 keys was
// faster, unfiltered and on a whole-pool route alike.
constexpr int64_t kComparisonSortMax = 16;
constexpr int64_t kWideDigitMin = 1024;
inline void radix_sort_keys(int64_t* keys, int64_t n, std::vector<uint64_t>& tmp, bool score_only = false);
inline void sort_keys_descending(int64_t* keys, int64_t n, std::vector<uint64_t>& tmp) {
  if (n <= kComparisonSortMax) {
    std::sort(keys, keys + n, std::greater<int64_t>());
    return;
  }
  radix_sort_keys(keys, n, tmp);
}
// The radix sort of sort_keys_descending, at any n (float_rank.cpp sorts a short top with it). score_only:
// the caller needs no order among equal scores (the low 32 bits are left unsorted).
inline void radix_sort_keys(int64_t* keys, int64_t n, std::vector<uint64_t>& tmp, bool score_only) {
  if (n <= 1) return;
  // descending signed order == ascending order of ~(key ^ sign bit) as unsigned
  uint64_t* a = reinterpret_cast<uint64_t*>(keys);
  uint64_t varies = 0;  // the bits where some key differs from the first: only their digits are sorted
  bool rows_ascending = true;  // the low 32 bits of a[i] are the row (common.py's key layout)
  for (int64_t i = 0; i < n; ++i) {
    a[i] = ~(a[i] ^ (uint64_t{1} << 63));
    varies |= a[i] ^ a[0];
    rows_ascending &= i == 0 || uint32_t(a[i]) > uint32_t(a[i - 1]);
  }
  // keys already in ascending row order (a scan's candidates in row order): the passes below are
  // stable, so sorting the score bits alone gives (score desc, row asc), half the passes at 1M rows
  if (rows_ascending || score_only) varies &= ~uint64_t{0xFFFFFFFF};
  const int width = n >= kWideDigitMin ? 11 : 8;
  const uint32_t mask = (1u << width) - 1;
  int shifts[8], nd = 0;  // 64 bits in digits of >= 8: at most 8
  for (uint64_t rest = varies; rest;) {
    const int s = __builtin_ctzll(rest);
    shifts[nd++] = s;
    rest = s + width >= 64 ? 0 : rest & (~uint64_t{0} << (s + width));
  }
  static thread_local uint32_t count[8][1 << 11];
  for (int j = 0; j < nd; ++j) std::memset(count[j], 0, sizeof(uint32_t) << width);
  for (int64_t i = 0; i < n; ++i)
    for (int j = 0; j < nd; ++j) ++count[j][(a[i] >> shifts[j]) & mask];
  tmp.resize(n);
  uint64_t *src = a, *dst = tmp.data();
  std::vector<uint32_t> pos(size_t{1} << width);  // a local: a thread_local array here ran the 0.024% k 4096 call ~10% slower
  for (int j = 0; j < nd; ++j) {
    uint32_t sum = 0;
    for (uint32_t d = 0; d <= mask; ++d) {
      pos[d] = sum;
      sum += count[j][d];
    }
    const int p = shifts[j];
    for (int64_t i = 0; i < n; ++i) dst[pos[(src[i] >> p) & mask]++] = src[i];
    std::swap(src, dst);
  }
  for (int64_t i = 0; i < n; ++i) a[i] = ~src[i] ^ (uint64_t{1} << 63);
}

}  // namespace silverrec
