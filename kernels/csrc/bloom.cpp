// silverrec::bloom_filter CPU path: per-query postfix filter programs over word windows.
//
//   bits       int64 [R, W]     row bank; word w of a row covers item rows 64w .. 64w + 63
//   ops        int64 [B, L]     opcodes (kernels/bloom_filter.py OP_*), NOP padding
//   rows       int64 [B, L, T]  PUSH operands: AND over t of bits[r] (r >= 0) or ~bits[~r] (r < 0)
//   word_start int64 [B, P]     first word of each window, -1 = empty window
//   -> int64 [B, P, n_words]    program_b on words word_start[b, p] + w (0 past W / empty windows)
//
// A query's P * n_words output words are evaluated in blocks of kBlock: every instruction is one
// AND / OR / NOT over a block of words on a small stack, so the interpretation cost is paid once
// per block, not per word. Blocks inside one window read the bank contiguously. Queries with the
// same program and windows (one filter for a whole request) are evaluated once and copied.
//
// bloom_filter_counts (silverrec::bloom_filter_counts) takes row ranges [lo, hi) instead of word
// starts: it evaluates only the words each range touches (windows sized per slot, not n_words),
// zeroes bits outside the range and returns per-window popcounts, fusing the IVF planner's counts.
#include <sys/mman.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "program.h"
#include "scan.h"
#include "team.h"

namespace silverrec {
namespace {

using namespace program;

// Queries with at least one window (first word / range start >= 0).
std::vector<int64_t> live_queries(const int64_t* starts, int64_t B, int64_t P) {
  std::vector<int64_t> live;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < P; ++p)
      if (starts[b * P + p] >= 0) {
        live.push_back(b);
        break;
      }
  return live;
}

// Zero-filled int64 tensor. Large outputs with few live queries (the filtered search's cluster
// masks when its queries take the posting route, whole-pool masks) come from fresh anonymous pages, which the kernel hands out
// zeroed: pages nobody writes or reads are never touched, instead of a memset of the whole output.
at::Tensor zeros_lazy(at::IntArrayRef sizes, int64_t live, int64_t B) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = size_t(numel) * sizeof(int64_t);
  if (bytes < (size_t{1} << 18) || 4 * live > B) return at::zeros(sizes, at::kLong);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return at::zeros(sizes, at::kLong);
  return at::from_blob(p, sizes, [bytes](void* q) { munmap(q, bytes); }, at::TensorOptions().dtype(at::kLong));
}

inline int64_t upto(int64_t n) { return n >= 64 ? ~int64_t{0} : (n <= 0 ? 0 : (int64_t{1} << n) - 1); }

}  // namespace

at::Tensor bloom_filter(const at::Tensor& bits, const at::Tensor& ops_t, const at::Tensor& rows_t,
                        const at::Tensor& word_start, int64_t n_words) {
  for (const at::Tensor* t : {&bits, &ops_t, &rows_t, &word_start})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "bloom_filter: contiguous int64 CPU tensors expected");
  const int64_t R = bits.size(0), W = bits.size(1), B = ops_t.size(0), L = ops_t.size(1), T = rows_t.size(2);
  const int64_t P = word_start.size(1);
  if (B == 0 || P == 0 || W == 0 || L == 0) return at::zeros({B, P, n_words}, at::kLong);
  const int64_t *bank = bits.data_ptr<int64_t>(), *ops = ops_t.data_ptr<int64_t>(), *rows = rows_t.data_ptr<int64_t>(),
                *starts = word_start.data_ptr<int64_t>();
  const std::vector<int64_t> live = live_queries(starts, B, P);
  at::Tensor out = zeros_lazy({B, P, n_words}, int64_t(live.size()), B);
  if (live.empty()) return out;
  validate(ops, rows, live, L, T, R);
  // identical (program, windows) queries are evaluated once and copied
  const std::vector<int64_t> rep = representatives(ops, rows, L, T, starts, nullptr, P, B);
  std::vector<int64_t> uniq;
  for (int64_t b : live)
    if (rep[b] == b) uniq.push_back(b);

  const int64_t per_query = P * n_words, blocks = (per_query + kBlock - 1) / kBlock;
  int64_t* o = out.data_ptr<int64_t>();
  team_for(0, int64_t(uniq.size()) * blocks, 4, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> stack((L + 1) * kBlock), widx(kBlock);
    std::vector<uint8_t> valid(kBlock);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = uniq[task / blocks], i0 = (task % blocks) * kBlock, n = std::min(kBlock, per_query - i0);
      // word index of every output position; contiguous = one window, all inside the bank
      bool any = false;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = (i0 + i) / n_words, s = starts[b * P + p], w = s + (i0 + i) % n_words;
        valid[i] = s >= 0 && w < W;
        widx[i] = valid[i] ? w : 0;
        any |= bool(valid[i]);
      }
      if (!any) continue;
      const bool contiguous = valid[0] && valid[n - 1] && widx[n - 1] - widx[0] == n - 1;
      eval_block(bank, W, ops, rows, L, T, b, widx[0], contiguous ? nullptr : widx.data(), n, stack.data());
      int64_t* dst = o + b * per_query + i0;
      for (int64_t i = 0; i < n; ++i) dst[i] = valid[i] ? stack[i] : 0;
    }
  });
  for (int64_t b : live)
    if (rep[b] != b) std::memcpy(o + b * per_query, o + rep[b] * per_query, per_query * sizeof(int64_t));
  return out;
}

// silverrec::bloom_filter_counts: windows given by item row ranges [lo, hi) (lo < 0 = empty): the
// window of (b, p) starts at word lo >> 6; only the words that range touches are evaluated (windows
// sized per slot, not n_words), bits outside [lo, hi) are 0, and counts[b, p] = set bits.
std::tuple<at::Tensor, at::Tensor> bloom_filter_counts(const at::Tensor& bits, const at::Tensor& ops_t,
                                                       const at::Tensor& rows_t, const at::Tensor& lo_t,
                                                       const at::Tensor& hi_t, int64_t n_words) {
  for (const at::Tensor* t : {&bits, &ops_t, &rows_t, &lo_t, &hi_t})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "bloom_filter_counts: contiguous int64 CPU tensors expected");
  const int64_t R = bits.size(0), W = bits.size(1), B = ops_t.size(0), L = ops_t.size(1), T = rows_t.size(2);
  const int64_t P = lo_t.size(1);
  at::Tensor counts = at::zeros({B, P}, at::kLong);
  if (B == 0 || P == 0 || W == 0 || L == 0) return {at::zeros({B, P, n_words}, at::kLong), counts};
  const int64_t *bank = bits.data_ptr<int64_t>(), *ops = ops_t.data_ptr<int64_t>(), *rows = rows_t.data_ptr<int64_t>(),
                *lo = lo_t.data_ptr<int64_t>(), *hi = hi_t.data_ptr<int64_t>();
  const std::vector<int64_t> live = live_queries(lo, B, P);
  at::Tensor out = zeros_lazy({B, P, n_words}, int64_t(live.size()), B);
  if (live.empty()) return {out, counts};
  validate(ops, rows, live, L, T, R);
  const std::vector<int64_t> rep = representatives(ops, rows, L, T, lo, hi, P, B);
  // tasks: (query, slot, first word in the window) blocks of the words each range touches
  struct Task {
    int64_t b, p, i0, n;
  };
  std::vector<Task> tasks;
  for (int64_t b : live) {
    if (rep[b] != b) continue;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t l = lo[b * P + p], h = hi[b * P + p];
      if (l < 0 || h <= l) continue;
      const int64_t w0 = l >> 6, nw = std::min({n_words, ((h + 63) >> 6) - w0, W - w0});
      for (int64_t i0 = 0; i0 < nw; i0 += kBlock) tasks.push_back({b, p, i0, std::min(kBlock, nw - i0)});
    }
  }
  std::vector<int64_t> part(tasks.size(), 0);
  int64_t* o = out.data_ptr<int64_t>();
  team_for(0, int64_t(tasks.size()), 16, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> stack((L + 1) * kBlock);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const Task& tk = tasks[ti];
      const int64_t l = lo[tk.b * P + tk.p], h = hi[tk.b * P + tk.p], w0 = (l >> 6) + tk.i0;
      eval_block(bank, W, ops, rows, L, T, tk.b, w0, nullptr, tk.n, stack.data());
      int64_t* dst = o + (tk.b * P + tk.p) * n_words + tk.i0;
      int64_t c = 0;
      for (int64_t i = 0; i < tk.n; ++i) {
        const int64_t first = 64 * (w0 + i);
        const int64_t v = stack[i] & upto(h - first) & ~upto(l - first);
        dst[i] = v;
        c += __builtin_popcountll(uint64_t(v));
      }
      part[ti] = c;
    }
  });
  int64_t* cnt = counts.data_ptr<int64_t>();
  for (size_t ti = 0; ti < tasks.size(); ++ti) cnt[tasks[ti].b * P + tasks[ti].p] += part[ti];
  for (int64_t b : live)
    if (rep[b] != b) {
      std::memcpy(o + b * P * n_words, o + rep[b] * P * n_words, P * n_words * sizeof(int64_t));
      std::memcpy(cnt + b * P, cnt + rep[b] * P, P * sizeof(int64_t));
    }
  return {out, counts};
}

}  // namespace silverrec
