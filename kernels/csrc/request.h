// The request encoding of a recommendation snapshot (kind "rec"), once, for every predictor: item ids to rows,
// stored users' histories, exclusions, the user tower's KeyedJaggedTensor (item keys by encode_histories, then the
// user features' vocabulary codes) and its dense columns. Python's predictor calls it through the custom class
// silverrec_host.RecEncoder (library.cpp; silverrec/serving/recommend.py), silverrec-predictor (predictor/) links it.
// A bad request is a RequestError whose message names the problem: Python raises it as QueryError, the C++
// predictor answers it with 400, the same text.
#pragma once

#include "tensor.h"

#include <torch/custom_class.h>

#include <optional>
#include <stdexcept>
#include <unordered_map>
#include <string>
#include <utility>
#include <vector>

namespace silverrec {

struct RequestError : std::invalid_argument {
  explicit RequestError(const std::string& m) : std::invalid_argument(m), message(m) {}
  std::string message;  // the whole message: what() stops at a NUL byte, which a filter string may hold
};

// One user's request (silverrec/serving/recommend.py RecRequest): exactly one of user_id and history.
struct UserRequest {
  std::optional<int64_t> user_id;
  std::optional<std::vector<int64_t>> history;  // item ids, oldest first
  std::vector<std::pair<std::string, std::vector<std::string>>> features;  // categorical: name -> values as text
  std::vector<std::pair<std::string, double>> numeric;
  std::vector<int64_t> exclude;  // item ids never to return
};

// The forward's user inputs for a batch: values int64 [nnz], lengths int32 [keys * B], dense float32 [B, 1 +
// numeric], exclude int64 [B, E] (-1 = none), and each request's history as rows (int64, time order; offsets [B + 1]).
struct EncodedUsers {
  at::Tensor values, lengths, dense, exclude, history_rows, history_offsets;
};

// Item id -> row: a dense table for compact ids (all >= 0, the largest below max(16 N, 2^20)), else a binary search.
class ItemRows {
 public:
  explicit ItemRows(const at::Tensor& row_to_item);
  int64_t row(int64_t id) const;  // -1 when the id is not in the pool
  int64_t size() const { return n_; }
  // ids -> rows; RequestError "{where}: unknown item id X (position p): not in the snapshot's pool".
  std::vector<int64_t> rows(const std::vector<int64_t>& ids, const std::string& where) const;

 private:
  int64_t n_ = 0;
  std::vector<int32_t> table_;  // dense: slot per id, -1 = none
  std::vector<int64_t> sorted_ids_, order_;
};

class RecEncoder : public torch::CustomClassHolder {
 public:
  // row_to_item int64 [N]; per item feature of the tower (its order) a CSR offsets int64 [N + 1] and codes int64;
  // the stored users (users.npz: user_ids int64 [U] sorted, offsets [U + 1], item_ids; has_users false: none);
  // the user vocabularies (name, then its values: code = position + 1), the numeric features (name, mean, std).
  RecEncoder(const at::Tensor& row_to_item, std::vector<at::Tensor> feature_offsets, std::vector<at::Tensor> feature_codes,
             bool has_users, const at::Tensor& user_ids, const at::Tensor& user_offsets, const at::Tensor& user_items,
             std::vector<std::string> vocab_names, std::vector<std::string> vocab_values, std::vector<int64_t> vocab_sizes,
             std::vector<std::string> numeric_names, std::vector<double> numeric_mean, std::vector<double> numeric_std,
             int64_t history_len, int64_t recent_len);

  // The batch's inputs (EncodedUsers). The exclusions of a request: its exclude ids' rows, then (exclude_history)
  // its history's rows, newest first, each once, up to exclude_limit in all. Errors, request by request in order
  // (one of user_id / history; the user stored; every id known; the exclusion limit), then the batch's unknown
  // numeric and categorical feature names.
  EncodedUsers encode(const std::vector<UserRequest>& requests, bool exclude_history, int64_t exclude_limit) const;
  const ItemRows& items() const { return items_; }
  int64_t num_items() const { return items_.size(); }

  // The custom class's methods (Python): encode with the requests flattened (recommend.py `_flat_requests`), rows.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> encode_flat(
      std::vector<int64_t> user_ids, std::vector<int64_t> given, std::vector<int64_t> ids, std::vector<int64_t> sizes,
      std::vector<std::string> feature_keys, std::vector<int64_t> key_counts, std::vector<std::string> feature_values,
      std::vector<int64_t> value_counts, std::vector<std::string> numeric_keys, std::vector<double> numeric_values,
      std::vector<int64_t> numeric_counts, bool exclude_history, int64_t exclude_limit) const;
  at::Tensor rows_op(std::vector<int64_t> ids, std::string where) const;

 private:
  std::vector<int64_t> user_history(int64_t user_id, const std::string& where) const;

  ItemRows items_;
  std::vector<at::Tensor> feature_offsets_, feature_codes_;
  bool has_users_;
  std::vector<int64_t> user_ids_, user_offsets_, user_rows_;  // user_rows_: -1 where a stored id left the pool
  std::vector<int64_t> user_items_;
  std::vector<std::string> vocab_names_;
  std::vector<std::vector<std::string>> vocab_values_;
  std::vector<std::unordered_map<std::string, int64_t>> vocab_index_;
  std::vector<std::string> numeric_names_;
  std::vector<double> numeric_mean_, numeric_std_;
  int64_t history_len_, recent_len_;
};

// Python's repr of a str (the error messages quote names as Python's f"{name!r}" does) and of a sorted list of them.
std::string py_repr(const std::string& s);
std::string py_list_repr(std::vector<std::string> names);

}  // namespace silverrec
