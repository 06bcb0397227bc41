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
// per block, not per word. Blocks inside one window read the bank contiguously.
#include <ATen/Parallel.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "scan.h"

namespace silverrec {
namespace {

enum Op : int64_t { kNop = 0, kPush, kAnd, kOr, kNot, kFalse, kTrue };
constexpr int64_t kBlock = 256;
constexpr int64_t kDelta[7] = {0, 1, -1, -1, 0, 1, 1};

// Validate the live queries' programs like kernels/bloom_filter.py (same messages, same order).
void validate(const int64_t* ops, const int64_t* rows, const std::vector<int64_t>& live, int64_t L, int64_t T, int64_t R) {
  for (int64_t b : live)
    for (int64_t l = 0; l < L; ++l)
      if (ops[b * L + l] < kNop || ops[b * L + l] > kTrue)
        throw std::invalid_argument("unknown opcode in filter program (valid: 0..6)");
  bool underflow = false, bad_final = false, bad_row = false;
  for (int64_t b : live) {
    int64_t depth = 0;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t op = ops[b * L + l];
      const int64_t need = (op == kAnd || op == kOr) ? 2 : (op == kNot ? 1 : 0);
      underflow |= depth < need;
      depth += kDelta[op];
      if (op == kPush)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t r = rows[(b * L + l) * T + t];
          bad_row |= r >= R || ~r >= R;
        }
    }
    bad_final |= depth != 1;
  }
  if (underflow) throw std::invalid_argument("malformed filter program: stack underflow");
  if (bad_final) throw std::invalid_argument("malformed filter program: it must leave exactly one result on the stack");
  if (bad_row) throw std::invalid_argument("filter program addresses a row outside the bank of " + std::to_string(R) + " rows");
}

}  // namespace

at::Tensor bloom_filter(const at::Tensor& bits, const at::Tensor& ops_t, const at::Tensor& rows_t,
                        const at::Tensor& word_start, int64_t n_words) {
  for (const at::Tensor* t : {&bits, &ops_t, &rows_t, &word_start})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "bloom_filter: contiguous int64 CPU tensors expected");
  const int64_t R = bits.size(0), W = bits.size(1), B = ops_t.size(0), L = ops_t.size(1), T = rows_t.size(2);
  const int64_t P = word_start.size(1);
  at::Tensor out = at::zeros({B, P, n_words}, at::kLong);
  if (B == 0 || P == 0 || W == 0 || L == 0) return out;
  const int64_t *bank = bits.data_ptr<int64_t>(), *ops = ops_t.data_ptr<int64_t>(), *rows = rows_t.data_ptr<int64_t>(),
                *starts = word_start.data_ptr<int64_t>();
  std::vector<int64_t> live;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < P; ++p)
      if (starts[b * P + p] >= 0) {
        live.push_back(b);
        break;
      }
  if (live.empty()) return out;
  validate(ops, rows, live, L, T, R);

  const int64_t per_query = P * n_words, blocks = (per_query + kBlock - 1) / kBlock;
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, int64_t(live.size()) * blocks, 4, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> stack((L + 1) * kBlock), widx(kBlock);
    std::vector<uint8_t> valid(kBlock);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = live[task / blocks], i0 = (task % blocks) * kBlock, n = std::min(kBlock, per_query - i0);
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
      int64_t depth = 0;
      for (int64_t l = 0; l < L; ++l) {
        const int64_t op = ops[b * L + l];
        int64_t* top = stack.data() + depth * kBlock;  // slot `depth` (the next free one)
        switch (op) {
          case kPush: {
            std::fill(top, top + n, ~int64_t{0});
            for (int64_t t = 0; t < T; ++t) {
              const int64_t r = rows[(b * L + l) * T + t];
              const int64_t flip = r < 0 ? ~int64_t{0} : 0;
              const int64_t* row = bank + (r < 0 ? ~r : r) * W;
              if (contiguous) {
                const int64_t* src = row + widx[0];
                for (int64_t i = 0; i < n; ++i) top[i] &= src[i] ^ flip;
              } else {
                for (int64_t i = 0; i < n; ++i) top[i] &= row[widx[i]] ^ flip;
              }
            }
            break;
          }
          case kAnd:
          case kOr: {
            int64_t *x = top - 2 * kBlock, *y = top - kBlock;
            if (op == kAnd)
              for (int64_t i = 0; i < n; ++i) x[i] &= y[i];
            else
              for (int64_t i = 0; i < n; ++i) x[i] |= y[i];
            break;
          }
          case kNot: {
            int64_t* x = top - kBlock;
            for (int64_t i = 0; i < n; ++i) x[i] = ~x[i];
            break;
          }
          case kFalse:
            std::fill(top, top + n, int64_t{0});
            break;
          case kTrue:
            std::fill(top, top + n, ~int64_t{0});
            break;
          default:
            break;
        }
        depth += kDelta[op];
      }
      int64_t* dst = o + b * per_query + i0;
      for (int64_t i = 0; i < n; ++i) dst[i] = valid[i] ? stack[i] : 0;
    }
  });
  return out;
}

}  // namespace silverrec
