// Scored: a re-scored row with its position in the search's list, and keep_best, the order both
// re-score kernels return (score descending, ties by list position): candidates.cpp, rescore.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace silverrec {

struct Scored {
  float score;
  int32_t pos;  // position in the search's list: the tie-break
  int64_t row;
};

// The best `top` of scored[0, m) moved to the front, best first. A re-scored list comes nearly in order
// (the scan's, near-ties swapped): an insertion sort, with no mispredicted comparisons for the entries
// already in place, unless it takes more than 8 moves an entry (then nth_element and a sort).
inline void keep_best(std::vector<Scored>& scored, int64_t m, int64_t top) {
  const auto better = [](const Scored& a, const Scored& b) {
    return a.score > b.score || (a.score == b.score && a.pos < b.pos);
  };
  int64_t moves = 0;
  for (int64_t i = 1; i < m && moves <= 8 * m; ++i) {
    const Scored x = scored[i];
    int64_t j = i;
    for (; j > 0 && better(x, scored[j - 1]); --j) scored[j] = scored[j - 1];
    scored[j] = x;
    moves += i - j;
  }
  if (moves <= 8 * m) return;  // all m in order
  if (top < m) std::nth_element(scored.begin(), scored.begin() + top, scored.begin() + m, better);
  std::sort(scored.begin(), scored.begin() + top, better);
}

}  // namespace silverrec
