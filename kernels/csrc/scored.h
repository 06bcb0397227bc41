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

// The best `top` of scored[0, m) moved to the front, best first.
inline void keep_best(std::vector<Scored>& scored, int64_t m, int64_t top) {
  const auto better = [](const Scored& a, const Scored& b) {
    return a.score > b.score || (a.score == b.score && a.pos < b.pos);
  };
  if (top < m) std::nth_element(scored.begin(), scored.begin() + top, scored.begin() + m, better);
  std::sort(scored.begin(), scored.begin() + top, better);
}

}  // namespace silverrec
