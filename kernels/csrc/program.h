// Filter-program evaluation shared by bloom.cpp (word windows) and filter_scan.cpp (rows).
//
// A program is postfix (opcodes kOp*: kernels/constants.py OP_*): PUSH ANDs T bank rows (r >= 0: bits[r],
// r < 0: ~bits[~r]); AND / OR / NOT combine the stack; NOP pads. `eval_block` runs program b over
// up to kBlock words at once (one instruction = one pass over the block), so interpretation cost
// is paid per block, not per word.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "constants.h"

namespace silverrec {
namespace program {

constexpr int64_t kBlock = 256;

// Validate the live queries' programs like kernels/bloom_filter.py (same messages, same order).
inline void validate(const int64_t* ops, const int64_t* rows, const std::vector<int64_t>& live, int64_t L, int64_t T, int64_t R) {
  for (int64_t b : live)
    for (int64_t l = 0; l < L; ++l)
      if (ops[b * L + l] < kOpNop || ops[b * L + l] > kOpTrue)
        throw std::invalid_argument("unknown opcode in filter program (valid: 0..6)");
  bool underflow = false, bad_final = false, bad_row = false;
  for (int64_t b : live) {
    int64_t depth = 0;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t op = ops[b * L + l];
      const int64_t need = (op == kOpAnd || op == kOpOr) ? 2 : (op == kOpNot ? 1 : 0);
      underflow |= depth < need;
      depth += kOpStackEffect[op];
      if (op == kOpPush)
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

// True when no program of the batch (ops int64 [B, L], contiguous) pushes a bank row: every
// instruction is TRUE / NOP (an unfiltered request), so every row passes.
inline bool pushes_nothing(const int64_t* ops, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (ops[i] != kOpTrue && ops[i] != kOpNop) return false;
  return true;
}

// Run program b on n <= kBlock words: contiguous (widx == nullptr: words w0 .. w0 + n - 1, all inside
// the bank) or gathered (widx[i]). The result is left in stack[0 .. n).
inline void eval_block(const int64_t* bank, int64_t W, const int64_t* ops, const int64_t* rows, int64_t L, int64_t T,
                int64_t b, int64_t w0, const int64_t* widx, int64_t n, int64_t* stack) {
  int64_t depth = 0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t op = ops[b * L + l];
    int64_t* top = stack + depth * kBlock;  // slot `depth` (the next free one)
    switch (op) {
      case kOpPush: {
        std::fill(top, top + n, ~int64_t{0});
        const int64_t* term = rows + (b * L + l) * T;
        for (int64_t t = 0; t < T; ++t) {
          const int64_t r = term[t];
          // a value plane is padded to T by repeating its row: AND is idempotent, read each row once
          // (a 3-term filter on 1M rows read 21 rows of 125 KB where 9 do)
          if (std::find(term, term + t, r) != term + t) continue;
          const int64_t flip = r < 0 ? ~int64_t{0} : 0;
          const int64_t* row = bank + (r < 0 ? ~r : r) * W;
          if (widx == nullptr) {
            const int64_t* src = row + w0;
            for (int64_t i = 0; i < n; ++i) top[i] &= src[i] ^ flip;
          } else {
            for (int64_t i = 0; i < n; ++i) top[i] &= row[widx[i]] ^ flip;
          }
        }
        break;
      }
      case kOpAnd:
      case kOpOr: {
        int64_t *x = top - 2 * kBlock, *y = top - kBlock;
        if (op == kOpAnd)
          for (int64_t i = 0; i < n; ++i) x[i] &= y[i];
        else
          for (int64_t i = 0; i < n; ++i) x[i] |= y[i];
        break;
      }
      case kOpNot: {
        int64_t* x = top - kBlock;
        for (int64_t i = 0; i < n; ++i) x[i] = ~x[i];
        break;
      }
      case kOpFalse:
        std::fill(top, top + n, int64_t{0});
        break;
      case kOpTrue:
        std::fill(top, top + n, ~int64_t{0});
        break;
      default:
        break;
    }
    depth += kOpStackEffect[op];
  }
}

// Queries whose program (ops, rows) and extra per-query words (`extra`, e.g. their windows) equal an
// earlier query's: rep[b] = that earlier query (or b). Identical requests are evaluated once. With `active`,
// only active queries represent others (an inactive query is its own): a caller that evaluates the active
// ones' groups must not find an active query's representative among the queries it skips.
inline std::vector<int64_t> representatives(const int64_t* ops, const int64_t* rows, int64_t L, int64_t T,
                                     const int64_t* extra, const int64_t* extra2, int64_t E, int64_t B,
                                     const bool* active = nullptr) {
  std::vector<int64_t> rep(B);
  std::unordered_map<uint64_t, std::vector<int64_t>> seen;
  auto same = [&](int64_t a, int64_t b) {
    return std::memcmp(ops + a * L, ops + b * L, L * sizeof(int64_t)) == 0 &&
           std::memcmp(rows + a * L * T, rows + b * L * T, L * T * sizeof(int64_t)) == 0 &&
           std::memcmp(extra + a * E, extra + b * E, E * sizeof(int64_t)) == 0 &&
           (extra2 == nullptr || std::memcmp(extra2 + a * E, extra2 + b * E, E * sizeof(int64_t)) == 0);
  };
  for (int64_t b = 0; b < B; ++b) {
    rep[b] = b;
    if (active && !active[b]) continue;
    uint64_t h = 1469598103934665603ull;
    auto mix = [&](const int64_t* p, int64_t n) {
      for (int64_t i = 0; i < n; ++i) h = (h ^ uint64_t(p[i])) * 1099511628211ull;
    };
    mix(ops + b * L, L);
    mix(rows + b * L * T, L * T);
    mix(extra + b * E, E);
    if (extra2) mix(extra2 + b * E, E);
    auto& bucket = seen[h];
    for (int64_t c : bucket)
      if (same(c, b)) {
        rep[b] = c;
        break;
      }
    if (rep[b] == b) bucket.push_back(b);
  }
  return rep;
}

}  // namespace program
}  // namespace silverrec
