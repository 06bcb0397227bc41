// The CPU kernels of the silverrec:: operators and the silverrec_host:: functions, as library.cpp registers
// them (one declaration each; the schemas are library.cpp's). Every argument as the schema names it; a bad
// argument is a ValueError (c10::ValueError, or std::invalid_argument, which library.cpp turns into one).
#pragma once

#include "tensor.h"

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace silverrec {

using Pair = std::tuple<at::Tensor, at::Tensor>;

// ---- model operators (kernels/*.py document each contract)
// ops.cpp
Pair ivf_scan(const at::Tensor& queries, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
              const at::Tensor& cluster_offsets, const at::Tensor& probes, int64_t k,
              const std::optional<at::Tensor>& bitmask, int64_t window_words, const std::optional<at::Tensor>& centroids,
              const std::optional<at::Tensor>& centroid_queries);
Pair filtered_topk(const at::Tensor& queries, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                   const at::Tensor& bits, at::TensorList program, at::TensorList postings, const at::Tensor& active,
                   int64_t k, int64_t max_candidates, at::TensorList residual);
at::Tensor rows_to_items(const at::Tensor& row_to_item, const at::Tensor& rows);
// ops.cpp: the arguments checked as kernels/*.py documents them, then bloom.cpp, filter_scan.cpp, plan.cpp and
// centroid_probe.cpp
at::Tensor bloom_filter_op(const at::Tensor& bits, const at::Tensor& ops, const at::Tensor& rows,
                           const at::Tensor& word_start, int64_t n_words);
Pair bloom_filter_counts_op(const at::Tensor& bits, const at::Tensor& ops, const at::Tensor& rows, const at::Tensor& lo,
                            const at::Tensor& hi, int64_t n_words);
Pair verify_topk_op(const at::Tensor& bits, const at::Tensor& ops, const at::Tensor& rows, const at::Tensor& scores,
                    const at::Tensor& result_rows, int64_t k);
std::tuple<at::Tensor, at::Tensor, at::Tensor> filter_plan_op(const at::Tensor& queries, at::TensorList index,
                                                              at::IntArrayRef params, double exact_cost_ratio,
                                                              at::TensorList program, const at::Tensor& mode, int64_t k,
                                                              int64_t nprobe, int64_t max_probe);
at::Tensor centroid_candidates_op(const at::Tensor& queries, const at::Tensor& centroids, int64_t P, bool screen);
// search.cpp
Pair filtered_ivf_search(const at::Tensor& queries, at::TensorList index, at::IntArrayRef params, double exact_cost_ratio,
                         at::TensorList program, const at::Tensor& mode, int64_t k, int64_t nprobe, int64_t max_probe,
                         int64_t rescore_margin, int64_t rescore_max_k);
Pair ivf_search(const at::Tensor& queries, at::TensorList index, at::IntArrayRef params, int64_t k, int64_t nprobe,
                int64_t rescore_margin, int64_t rescore_max_k);
// rescore.cpp, candidates.cpp, mol.cpp
Pair rescore_rows(const at::Tensor& queries, const at::Tensor& found, const at::Tensor& codes, const at::Tensor& dim_scale,
                  const at::Tensor& dim_offset, int64_t k, const std::optional<at::Tensor>& cluster_offsets,
                  const std::optional<at::Tensor>& centroids);
at::Tensor candidate_rows(const at::Tensor& queries, const at::Tensor& found, const at::Tensor& exclude, const at::Tensor& emb,
                          int64_t k0, int64_t limit, bool intersection);
at::Tensor mol_score(const at::Tensor& user, const at::Tensor& rows, const at::Tensor& emb, const at::Tensor& ranker,
                     at::TensorList weights, at::IntArrayRef dims);
// attention.cpp
Pair merge_attention_states(const at::Tensor& v_a, const at::Tensor& s_a, const at::Tensor& v_b, const at::Tensor& s_b);
at::Tensor staged_attention(const at::Tensor& q, const at::Tensor& shared_k, const at::Tensor& shared_v,
                            const at::Tensor& key_valid, const at::Tensor& unshared_k, const at::Tensor& unshared_v,
                            int64_t n_unshared);
// beam.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> beam_topk(const at::Tensor& beam_scores, const at::Tensor& logprobs,
                                                         int64_t top_k, int64_t beam_width);
// the same selection on every beam (no early exit, no host read): the CUDA kernel
std::tuple<at::Tensor, at::Tensor, at::Tensor> beam_topk_every_beam(const at::Tensor& beam_scores,
                                                                    const at::Tensor& logprobs, int64_t top_k,
                                                                    int64_t beam_width);

// ---- host functions (silverrec_host::): the predictor's request encoding, the kernels' parts for tests
// ops.cpp
at::Tensor ivf_scan_keys_op(const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& cluster_offsets,
                            const at::Tensor& probes, const std::optional<at::Tensor>& bitmask, int64_t k,
                            const std::optional<at::Tensor>& bias);
Pair quantize_queries(const at::Tensor& queries);
Pair keys_to_results(const at::Tensor& keys, const at::Tensor& qscale, const at::Tensor& qsum, const at::Tensor& scale,
                     const at::Tensor& offset);
// encode.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_histories(
    const at::Tensor& rows, const at::Tensor& offsets, int64_t exclude_limit, int64_t history_len, int64_t recent_len,
    at::TensorList feature_offsets, at::TensorList feature_codes, int64_t num_items);
std::tuple<at::Tensor, at::Tensor, int64_t> lookup_ids(at::IntArrayRef ids, at::IntArrayRef sizes, const at::Tensor& table);

}  // namespace silverrec
