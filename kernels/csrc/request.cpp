// The request encoding of a recommendation snapshot (request.h): one implementation for Python's predictor and
// silverrec-predictor.
#include "request.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <sstream>

#include "ops.h"
#include "row_counts.h"

namespace silverrec {

namespace {

std::vector<int64_t> to_vector(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong && t.dim() == 1, "RecEncoder: ", what, " must be int64 [n]");
  const at::Tensor c = t.contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

at::Tensor long_tensor(const std::vector<int64_t>& v) {
  at::Tensor t = at::empty({int64_t(v.size())}, at::kLong);
  if (!v.empty()) std::memcpy(t.data_ptr<int64_t>(), v.data(), v.size() * sizeof(int64_t));
  return t;
}

std::string unknown_id(const std::string& where, int64_t id, size_t position) {
  return where + ": unknown item id " + std::to_string(id) + " (position " + std::to_string(position) +
         "): not in the snapshot's pool";
}

}  // namespace

namespace {
// Characters Python's repr escapes beyond ASCII (str.isprintable false): the C1 controls, NBSP and SHY, the other
// space and format characters in common use, surrogates and private use (unassigned ones are printed).
bool unprintable(uint32_t c) {
  return (c >= 0x80 && c <= 0xa0) || c == 0xad || c == 0x61c || c == 0x1680 || c == 0x180e ||
         (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) || (c >= 0x205f && c <= 0x206f) ||
         c == 0x3000 || c == 0xfeff || (c >= 0xd800 && c <= 0xf8ff) || (c >= 0xfff9 && c <= 0xfffb);
}
}  // namespace

std::string py_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    char buf[16];
    if (c >= 0x80) {  // a UTF-8 sequence: as is, or escaped as Python escapes it
      const size_t len = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
      uint32_t v = len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
      size_t n = 1;
      for (; n < len && i + n < s.size(); ++n) v = (v << 6) | (static_cast<unsigned char>(s[i + n]) & 0x3f);
      if (len > 1 && unprintable(v)) {
        std::snprintf(buf, sizeof buf, v <= 0xff ? "\\x%02x" : v <= 0xffff ? "\\u%04x" : "\\U%08x", v);
        out += buf;
      } else {
        out.append(s, i, n);
      }
      i += n - 1;
    } else if (c == '\\') out += "\\\\";
    else if (c == q) out += std::string("\\") + char(q);
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else out += char(c);
  }
  return out + q;
}

std::string py_list_repr(std::vector<std::string> names) {
  std::sort(names.begin(), names.end());
  std::string out = "[";
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + py_repr(names[i]);
  return out + "]";
}

// ------------------------------------------------------------------------------------------------ ItemRows
ItemRows::ItemRows(const at::Tensor& row_to_item) {
  const std::vector<int64_t> ids = to_vector(row_to_item, "row_to_item");
  n_ = int64_t(ids.size());
  if (ids.empty()) return;
  const auto [lo, hi] = std::minmax_element(ids.begin(), ids.end());
  if (*lo >= 0 && *hi < std::max<int64_t>(16 * n_, 1 << 20)) {
    table_.assign(size_t(*hi + 1), -1);
    for (int64_t r = 0; r < n_; ++r) table_[size_t(ids[r])] = int32_t(r);
    return;
  }
  order_.resize(ids.size());
  for (int64_t r = 0; r < n_; ++r) order_[r] = r;
  std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  sorted_ids_.resize(ids.size());
  for (int64_t i = 0; i < n_; ++i) sorted_ids_[i] = ids[order_[i]];
}

int64_t ItemRows::row(int64_t id) const {
  if (!table_.empty()) return id < 0 || id >= int64_t(table_.size()) ? -1 : table_[size_t(id)];
  const auto it = std::lower_bound(sorted_ids_.begin(), sorted_ids_.end(), id);
  return it != sorted_ids_.end() && *it == id ? order_[size_t(it - sorted_ids_.begin())] : -1;
}

std::vector<int64_t> ItemRows::rows(const std::vector<int64_t>& ids, const std::string& where) const {
  std::vector<int64_t> out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    if ((out[i] = row(ids[i])) < 0) throw RequestError(unknown_id(where, ids[i], i));
  return out;
}

// ------------------------------------------------------------------------------------------------ RecEncoder
RecEncoder::RecEncoder(const at::Tensor& row_to_item, std::vector<at::Tensor> feature_offsets,
                       std::vector<at::Tensor> feature_codes, bool has_users, const at::Tensor& user_ids,
                       const at::Tensor& user_offsets, const at::Tensor& user_items, std::vector<std::string> vocab_names,
                       std::vector<std::string> vocab_values, std::vector<int64_t> vocab_sizes,
                       std::vector<std::string> numeric_names, std::vector<double> numeric_mean,
                       std::vector<double> numeric_std, int64_t history_len, int64_t recent_len)
    : items_(row_to_item), has_users_(has_users), vocab_names_(std::move(vocab_names)),
      numeric_names_(std::move(numeric_names)), numeric_mean_(std::move(numeric_mean)),
      numeric_std_(std::move(numeric_std)), history_len_(history_len), recent_len_(recent_len) {
  TORCH_CHECK_VALUE(feature_offsets.size() == feature_codes.size(), "RecEncoder: one offsets and one codes per feature");
  for (size_t f = 0; f < feature_offsets.size(); ++f) {
    feature_offsets_.push_back(feature_offsets[f].to(at::kLong).contiguous());
    feature_codes_.push_back(feature_codes[f].to(at::kLong).contiguous());
  }
  TORCH_CHECK_VALUE(vocab_sizes.size() == vocab_names_.size(), "RecEncoder: one size per user vocabulary");
  TORCH_CHECK_VALUE(numeric_mean_.size() == numeric_names_.size() && numeric_std_.size() == numeric_names_.size(),
                    "RecEncoder: a mean and a std per numeric feature");
  size_t at_value = 0;
  for (int64_t size : vocab_sizes) {
    TORCH_CHECK_VALUE(size >= 0 && at_value + size_t(size) <= vocab_values.size(), "RecEncoder: vocabulary sizes");
    vocab_values_.emplace_back(vocab_values.begin() + at_value, vocab_values.begin() + at_value + size);
    std::unordered_map<std::string, int64_t> index;
    for (int64_t i = 0; i < size; ++i) index.emplace(vocab_values[at_value + i], i + 1);
    vocab_index_.push_back(std::move(index));
    at_value += size_t(size);
  }
  if (has_users_) {
    user_ids_ = to_vector(user_ids, "user_ids");
    user_offsets_ = to_vector(user_offsets, "user offsets");
    user_items_ = to_vector(user_items, "user item_ids");
    TORCH_CHECK_VALUE(user_offsets_.size() == user_ids_.size() + 1 && user_offsets_.back() == int64_t(user_items_.size()),
                      "RecEncoder: user offsets must be [U + 1] over the item ids");
    user_rows_.resize(user_items_.size());
    for (size_t i = 0; i < user_items_.size(); ++i) user_rows_[i] = items_.row(user_items_[i]);
  }
}

std::vector<int64_t> RecEncoder::user_history(int64_t user_id, const std::string& where) const {
  if (!has_users_)
    throw RequestError(where + ": this snapshot stores no user histories; send the history instead of user_id");
  const auto it = std::lower_bound(user_ids_.begin(), user_ids_.end(), user_id);
  if (it == user_ids_.end() || *it != user_id)
    throw RequestError(where + ": unknown user_id " + std::to_string(user_id) +
                       ": not a user of the snapshot's training logs");
  const size_t u = size_t(it - user_ids_.begin());
  const int64_t lo = user_offsets_[u], hi = user_offsets_[u + 1];
  std::vector<int64_t> rows(user_rows_.begin() + lo, user_rows_.begin() + hi);
  for (int64_t i = 0; i < hi - lo; ++i)  // an item deleted by an update since the history was stored
    if (rows[size_t(i)] < 0) throw RequestError(unknown_id(where + " history", user_items_[size_t(lo + i)], size_t(i)));
  return rows;
}

EncodedUsers RecEncoder::encode(const std::vector<UserRequest>& requests, bool exclude_history,
                                int64_t exclude_limit) const {
  TORCH_CHECK_VALUE(exclude_limit >= 1, "RecEncoder.encode: exclude_limit must be >= 1");
  const int64_t B = int64_t(requests.size());
  std::vector<int64_t> rows, offsets{0};
  std::vector<std::vector<int64_t>> excluded(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const UserRequest& r = requests[size_t(b)];
    const std::string where = "request " + std::to_string(b);
    if (r.user_id.has_value() == r.history.has_value())
      throw RequestError(where + ": give exactly one of user_id and history");
    const std::vector<int64_t> hist = r.user_id ? user_history(*r.user_id, where) : items_.rows(*r.history, where + " history");
    // the exclusions: the exclude ids' rows once each, then the history's newest first, up to the limit
    std::vector<int64_t>& ex = excluded[size_t(b)];
    const std::vector<int64_t> ex_rows = items_.rows(r.exclude, where + " exclude");
    RowCounts seen(int64_t(ex_rows.size() + hist.size()));
    for (int64_t row : ex_rows) {
      int32_t& s = seen.at(row);
      if (!s) ex.push_back(row);
      s = 1;
    }
    if (int64_t(ex.size()) > exclude_limit)
      throw RequestError(where + ": " + std::to_string(ex.size()) + " exclude ids exceed the exclusion limit " +
                         std::to_string(exclude_limit));
    for (auto it = hist.rbegin(); exclude_history && it != hist.rend() && int64_t(ex.size()) < exclude_limit; ++it) {
      int32_t& s = seen.at(*it);
      if (!s) ex.push_back(*it);
      s = 1;
    }
    rows.insert(rows.end(), hist.begin(), hist.end());
    offsets.push_back(int64_t(rows.size()));
  }
  std::set<std::string> unknown_numeric, unknown_features;
  for (const UserRequest& r : requests) {
    for (const auto& [name, value] : r.numeric)
      if (std::find(numeric_names_.begin(), numeric_names_.end(), name) == numeric_names_.end())
        unknown_numeric.insert(name);
    for (const auto& [name, values] : r.features)
      if (std::find(vocab_names_.begin(), vocab_names_.end(), name) == vocab_names_.end())
        unknown_features.insert(name);
  }
  if (!unknown_numeric.empty())
    throw RequestError("unknown numeric user feature " + py_repr(*unknown_numeric.begin()) + ": the user tower reads " +
                       (numeric_names_.empty() ? std::string("none") : py_list_repr(numeric_names_)));
  if (!unknown_features.empty())
    throw RequestError("unknown user feature " + py_repr(*unknown_features.begin()) + ": the user tower reads " +
                       (vocab_names_.empty() ? std::string("none") : py_list_repr(vocab_names_)));

  // the item keys (encode_histories), then each user vocabulary's key, request after request
  const at::Tensor rows_t = long_tensor(rows), offsets_t = long_tensor(offsets);
  auto [unused, values, lengths] = encode_histories(rows_t, offsets_t, 0, history_len_, recent_len_, feature_offsets_,
                                                    feature_codes_, num_items());
  if (!vocab_names_.empty()) {
    std::vector<int64_t> codes;
    std::vector<int32_t> counts;
    for (size_t g = 0; g < vocab_names_.size(); ++g)
      for (const UserRequest& r : requests) {
        int32_t n = 0;
        for (const auto& [name, vals] : r.features)
          if (name == vocab_names_[g])
            for (const std::string& v : vals) {
              const auto it = vocab_index_[g].find(v);
              codes.push_back(it == vocab_index_[g].end() ? 0 : it->second);
              ++n;
            }
        counts.push_back(n);
      }
    const int64_t base = values.numel(), keys = lengths.numel();
    at::Tensor v = at::empty({base + int64_t(codes.size())}, at::kLong), l = at::empty({keys + int64_t(counts.size())}, at::kInt);
    std::memcpy(v.data_ptr<int64_t>(), values.data_ptr<int64_t>(), size_t(base) * sizeof(int64_t));
    std::copy(codes.begin(), codes.end(), v.data_ptr<int64_t>() + base);
    std::memcpy(l.data_ptr<int32_t>(), lengths.data_ptr<int32_t>(), size_t(keys) * sizeof(int32_t));
    std::copy(counts.begin(), counts.end(), l.data_ptr<int32_t>() + keys);
    values = v;
    lengths = l;
  }
  // dense: log1p of each full history's size, then the standardised numeric features (0 where not sent)
  const int64_t D = 1 + int64_t(numeric_names_.size());
  at::Tensor dense = at::zeros({B, D}, at::kFloat);
  float* d = dense.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    d[b * D] = float(std::log1p(double(offsets[size_t(b) + 1] - offsets[size_t(b)])));
    for (const auto& [name, x] : requests[size_t(b)].numeric) {
      const size_t j = size_t(std::find(numeric_names_.begin(), numeric_names_.end(), name) - numeric_names_.begin());
      d[b * D + 1 + int64_t(j)] = float((x - numeric_mean_[j]) / numeric_std_[j]);
    }
  }
  int64_t width = 1;
  for (const auto& ex : excluded) width = std::max(width, int64_t(ex.size()));
  at::Tensor exclude = at::full({B, width}, -1, at::kLong);
  for (int64_t b = 0; b < B; ++b) std::copy(excluded[size_t(b)].begin(), excluded[size_t(b)].end(), exclude.data_ptr<int64_t>() + b * width);
  return {values, lengths, dense, exclude, rows_t, offsets_t};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> RecEncoder::encode_flat(
    std::vector<int64_t> user_ids, std::vector<int64_t> given, std::vector<int64_t> ids, std::vector<int64_t> sizes,
    std::vector<std::string> feature_keys, std::vector<int64_t> key_counts, std::vector<std::string> feature_values,
    std::vector<int64_t> value_counts, std::vector<std::string> numeric_keys, std::vector<double> numeric_values,
    std::vector<int64_t> numeric_counts, bool exclude_history, int64_t exclude_limit) const {
  // given[b]: bit 0 user_id, bit 1 history; ids: per request its history's ids, then its exclude ids (sizes [2B]);
  // per request key_counts[b] feature keys (value_counts: each key's values) and numeric_counts[b] numeric pairs
  const size_t B = given.size();
  TORCH_CHECK_VALUE(user_ids.size() == B && sizes.size() == 2 * B && key_counts.size() == B && numeric_counts.size() == B &&
                        value_counts.size() == feature_keys.size() && numeric_keys.size() == numeric_values.size(),
                    "RecEncoder.encode: inconsistent flattened requests");
  std::vector<UserRequest> requests(B);
  size_t at_id = 0, at_key = 0, at_value = 0, at_num = 0;
  for (size_t b = 0; b < B; ++b) {
    UserRequest& r = requests[b];
    if (given[b] & 1) r.user_id = user_ids[b];
    std::vector<int64_t> hist(ids.begin() + at_id, ids.begin() + at_id + sizes[2 * b]);
    at_id += size_t(sizes[2 * b]);
    if (given[b] & 2) r.history = std::move(hist);
    r.exclude.assign(ids.begin() + at_id, ids.begin() + at_id + sizes[2 * b + 1]);
    at_id += size_t(sizes[2 * b + 1]);
    for (int64_t i = 0; i < key_counts[b]; ++i, ++at_key) {
      r.features.emplace_back(feature_keys[at_key], std::vector<std::string>(feature_values.begin() + at_value,
                                                                             feature_values.begin() + at_value + value_counts[at_key]));
      at_value += size_t(value_counts[at_key]);
    }
    for (int64_t i = 0; i < numeric_counts[b]; ++i, ++at_num) r.numeric.emplace_back(numeric_keys[at_num], numeric_values[at_num]);
  }
  const EncodedUsers e = encode(requests, exclude_history, exclude_limit);
  return {e.values, e.lengths, e.dense, e.exclude, e.history_rows, e.history_offsets};
}

at::Tensor RecEncoder::rows_op(std::vector<int64_t> ids, std::string where) const { return long_tensor(items_.rows(ids, where)); }

}  // namespace silverrec
