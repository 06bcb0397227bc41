// The predictor's request encoding of history rows in one call (silverrec/serving/recommend.py
// `RecHandler.encode_rows`; its numpy path, `FeatureEncoder.encode` with the exclusions of
// `newest_unique_grouped`, is the reference): per request, the exclusions (its distinct rows, newest
// first, at most exclude_limit) and the user tower's item keys of the KeyedJaggedTensor.
//
// Why in C++: at batch 1 the numpy path is some forty small calls (~0.2 ms after a forward has
// evicted the interpreter's caches), a fifth of a MovieLens recommend; the work itself is a few
// hundred rows.
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "row_counts.h"

namespace silverrec {

// rows int64 [R] (every request's history rows in time order, request after request), offsets int64
// [B + 1]; exclude_limit 0 = no exclusions; feature CSRs (offsets int64 [N + 1], codes int64) in the
// tower's item-feature order ->
//   exclude int64 [B, E] (E = the largest count, >= 1; each row newest first, -1 after),
//   values int64 (hist_item: each request's last history_len rows; recent_item: their last
//     recent_len; then per feature the codes of every hist_item row, request after request),
//   lengths int32 [(2 + F) * B] (key-major, as FeatureEncoder.encode).
std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_histories(
    const at::Tensor& rows_in, const at::Tensor& offsets_in, int64_t exclude_limit, int64_t history_len,
    int64_t recent_len, at::TensorList feature_offsets, at::TensorList feature_codes, int64_t num_items) {
  const at::Tensor rows = rows_in.contiguous(), offsets = offsets_in.contiguous();
  TORCH_CHECK(rows.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                  offsets.size(0) >= 1,
              "encode_histories: rows and offsets must be int64, offsets [B + 1]");
  TORCH_CHECK(feature_offsets.size() == feature_codes.size(), "encode_histories: one offsets and one codes tensor per feature");
  TORCH_CHECK(history_len >= 1 && recent_len >= 1 && recent_len <= history_len && exclude_limit >= 0,
              "encode_histories: need 1 <= recent_len <= history_len, exclude_limit >= 0");
  const int64_t B = offsets.size(0) - 1, F = int64_t(feature_offsets.size());
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[B] == rows.numel(), "encode_histories: offsets must run from 0 to len(rows)");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(off[b + 1] >= off[b], "encode_histories: offsets must not decrease");
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < num_items, "encode_histories: row ", r[i], " outside the pool's [0, ", num_items, ")");
  std::vector<const int64_t*> foff(F), fcode(F);
  for (int64_t f = 0; f < F; ++f) {
    TORCH_CHECK(feature_offsets[f].scalar_type() == at::kLong && feature_offsets[f].is_contiguous() &&
                    feature_offsets[f].numel() == num_items + 1 && feature_codes[f].scalar_type() == at::kLong &&
                    feature_codes[f].is_contiguous(),
                "encode_histories: feature ", f, " needs contiguous int64 offsets [N + 1] and codes");
    foff[f] = feature_offsets[f].data_ptr<int64_t>();
    fcode[f] = feature_codes[f].data_ptr<int64_t>();
  }

  // exclusions: newest first, each row once
  std::vector<int64_t> ex_rows;
  std::vector<int64_t> ex_count(B, 0);
  int64_t width = 1;
  if (exclude_limit > 0) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = off[b + 1] - off[b];
      RowCounts seen(std::min(n, exclude_limit));
      for (int64_t i = off[b + 1] - 1; i >= off[b] && ex_count[b] < exclude_limit; --i) {
        int32_t& s = seen.at(r[i]);
        if (s) continue;
        s = 1;
        ex_rows.push_back(r[i]);
        ++ex_count[b];
      }
      width = std::max(width, ex_count[b]);
    }
  }
  at::Tensor exclude = at::full({B, width}, -1, at::kLong);
  int64_t* ex = exclude.data_ptr<int64_t>();
  for (int64_t b = 0, k = 0; b < B; k += ex_count[b], ++b) std::copy_n(ex_rows.begin() + k, ex_count[b], ex + b * width);

  // the item keys: sizes first, then one fill
  at::Tensor lengths = at::empty({(2 + F) * B}, at::kInt);
  int32_t* len = lengths.data_ptr<int32_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t h = std::min(off[b + 1] - off[b], history_len);
    len[b] = int32_t(h);
    len[B + b] = int32_t(std::min(h, recent_len));
    total += h + std::min(h, recent_len);
    for (int64_t f = 0; f < F; ++f) {
      int64_t c = 0;
      for (int64_t i = off[b + 1] - h; i < off[b + 1]; ++i) c += foff[f][r[i] + 1] - foff[f][r[i]];
      len[(2 + f) * B + b] = int32_t(c);
      total += c;
    }
  }
  at::Tensor values = at::empty({total}, at::kLong);
  int64_t* v = values.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) v = std::copy(r + off[b + 1] - len[b], r + off[b + 1], v);
  for (int64_t b = 0; b < B; ++b) v = std::copy(r + off[b + 1] - len[B + b], r + off[b + 1], v);
  for (int64_t f = 0; f < F; ++f)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = off[b + 1] - len[b]; i < off[b + 1]; ++i)
        v = std::copy(fcode[f] + foff[f][r[i]], fcode[f] + foff[f][r[i] + 1], v);
  return {exclude, values, lengths};
}

// Item ids of sent histories -> canonical rows by the predictor's dense id table (ItemRows.table:
// int32, one slot per id up to the largest, a -1 sentinel in the last slot) in one call: ids int64 (every
// list's ids, list after list) and sizes int64 [L] -> (rows int64 [sum of sizes], offsets int64 [L + 1], the
// first list holding an unknown id or -1). Replaces a numpy conversion, concatenation, lookup and check per
// batch (~50 us at batch 1 after a forward).
std::tuple<at::Tensor, at::Tensor, int64_t> lookup_ids(at::IntArrayRef ids, at::IntArrayRef sizes, const at::Tensor& table_in) {
  const at::Tensor table = table_in.contiguous();
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 1 && table.numel() >= 1,
              "lookup_ids: table must be int32 [M] with a -1 sentinel last");
  const int32_t* t = table.data_ptr<int32_t>();
  const int64_t last = table.numel() - 1;
  const int64_t L = int64_t(sizes.size());
  at::Tensor offsets = at::empty({L + 1}, at::kLong);
  int64_t* off = offsets.data_ptr<int64_t>();
  off[0] = 0;
  for (int64_t j = 0; j < L; ++j) {
    TORCH_CHECK_VALUE(sizes[j] >= 0, "lookup_ids: sizes must be >= 0");
    off[j + 1] = off[j] + sizes[j];
  }
  TORCH_CHECK_VALUE(off[L] == int64_t(ids.size()), "lookup_ids: sizes add up to ", off[L], ", ids holds ", ids.size());
  at::Tensor rows = at::empty({off[L]}, at::kLong);
  int64_t* r = rows.data_ptr<int64_t>();
  int64_t bad = -1;
  for (int64_t j = 0; j < L; ++j)
    for (int64_t i = off[j]; i < off[j + 1]; ++i) {
      const int64_t id = ids[i], row = t[id < 0 || id > last ? last : id];  // outside the table: the sentinel
      if (row < 0 && bad < 0) bad = j;
      *r++ = row;
    }
  return {rows, offsets, bad};
}

}  // namespace silverrec
