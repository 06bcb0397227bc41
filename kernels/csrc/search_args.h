// The IVF search ops' structured arguments (kernels/search_args.py): the index as a tensor list and an int
// list, the request's filter programs as a tensor list, unpacked by the positions constants.h defines
// (kernels/constants.py IVF_TENSORS, FILTERED_IVF_TENSORS, IVF_PARAMS, FILTERED_IVF_PARAMS, PROGRAM_TENSORS).
#pragma once

#include "tensor.h"

#include <stdexcept>
#include <string>

#include "constants.h"

namespace silverrec {

// The IVF: tensors contiguous, centroids float32 (the plan and the residual terms read them so).
struct IvfIndex {
  at::Tensor codes, dim_scale, dim_offset, cluster_offsets, centroids, row_to_item;
  int64_t window_words = 0;
  bool residual = false;  // codes quantise item - centroid of its cluster
};

// The filter indexes beside it: the row bank and the posting lists, and the routing formula's parameters.
struct FilterIndex {
  at::Tensor bits, post_rows, post_offsets, post_sizes;
  int64_t match_factor = 0, num_items = 0, posting_limit = 0;
  double exact_cost_ratio = 0.0;
};

// The request's filter programs: Bloom program (ops, rows), verify program (vops, vrows), posting lists.
struct Program {
  at::Tensor ops, rows, vops, vrows, lists;
};

// A ValueError (std::invalid_argument) unless `got` == `want` entries.
inline void check_count(const char* op, const char* what, size_t got, int64_t want) {
  if (int64_t(got) != want)
    throw std::invalid_argument(std::string(op) + ": " + what + " must hold " + std::to_string(want) +
                                " entries (kernels/constants.py), got " + std::to_string(got));
}

// The first IVF_TENSORS of `tensors` and IVF_PARAMS of `params` (a filtered index's lists begin with them).
inline IvfIndex ivf_index(at::TensorList tensors, at::IntArrayRef params) {
  namespace t = ivf_tensors;
  namespace p = ivf_params;
  IvfIndex ix;
  ix.codes = tensors[t::kCodes].contiguous();
  ix.dim_scale = tensors[t::kDimScale].contiguous();
  ix.dim_offset = tensors[t::kDimOffset].contiguous();
  ix.cluster_offsets = tensors[t::kClusterOffsets].contiguous();
  const at::Tensor c = tensors[t::kCentroids].contiguous();
  ix.centroids = c.scalar_type() == at::kFloat ? c : c.to(at::kFloat).contiguous();
  ix.row_to_item = tensors[t::kRowToItem].contiguous();
  ix.window_words = params[p::kWindowWords];
  ix.residual = params[p::kResidual] != 0;
  return ix;
}

inline IvfIndex plain_index(const char* op, at::TensorList tensors, at::IntArrayRef params) {
  check_count(op, "index", tensors.size(), ivf_tensors::kCount);
  check_count(op, "params", params.size(), ivf_params::kCount);
  return ivf_index(tensors, params);
}

inline FilterIndex filter_index(const char* op, at::TensorList tensors, at::IntArrayRef params, double exact_cost_ratio) {
  namespace t = filtered_ivf_tensors;
  namespace p = filtered_ivf_params;
  check_count(op, "index", tensors.size(), t::kCount);
  check_count(op, "params", params.size(), p::kCount);
  FilterIndex fx;
  fx.bits = tensors[t::kBits].contiguous();
  fx.post_rows = tensors[t::kPostRows].contiguous();
  fx.post_offsets = tensors[t::kPostOffsets].contiguous();
  fx.post_sizes = tensors[t::kPostSizes].contiguous();
  fx.match_factor = params[p::kMatchFactor];
  fx.num_items = params[p::kNumItems];
  fx.posting_limit = params[p::kPostingLimit];
  fx.exact_cost_ratio = exact_cost_ratio;
  return fx;
}

inline Program request_program(const char* op, at::TensorList tensors) {
  namespace t = program_tensors;
  check_count(op, "program", tensors.size(), t::kCount);
  return {tensors[t::kOps], tensors[t::kRows], tensors[t::kVops], tensors[t::kVrows], tensors[t::kLists]};
}

}  // namespace silverrec
