// The filter language (docs/filtering.md), once, for every predictor: the parser of filter strings, the compiler
// of their ASTs into the postfix programs the filtered search reads (Bloom and verify programs, posting lists) and
// the estimate of the items they pass. Python calls it through silverrec_host.parse_filter and the custom class
// silverrec_host.FilterCompiler (library.cpp; silverrec/filtering/filter_lang.py and filter_program.py are thin
// wrappers), silverrec-predictor (predictor/) links it. A bad filter is a RequestError whose message names the
// problem and its 0-based character position: Python raises it as a QueryError (FilterSyntaxError when it does
// not parse), the C++ predictor answers it with 400, the same text.
//
// Grammar (keywords case-insensitive, values bare or quoted with '...' or "..."):
//     filter   := or_expr
//     or_expr  := and_expr ( OR and_expr )*
//     and_expr := not_expr ( AND not_expr )*
//     not_expr := NOT not_expr | primary
//     primary  := '(' or_expr ')' | NAME '=' VALUE | NAME '!=' VALUE | NAME IN '(' VALUE (',' VALUE)* ')'
//               | NAME NOT IN '(' ... ')'
// A multi-valued feature matches `NAME = VALUE` when any of the item's values equals VALUE.
//
// Semantics of the compiled programs (kernels/constants.py OP_*; ops int64 [L], rows int64 [L, T] per filter):
// - a positive term `f = v` is a Bloom test (the AND of v's K hashed bit rows: false positives possible, never a
//   false negative); a negated one (under an odd number of NOTs) reads the feature's exact value-code planes when
//   it has them; the verify program (exact_positive) reads them for positive terms too;
// - a value with its own bit plane (too frequent for a posting list) is one exact row in both programs;
// - a value outside the feature's vocabulary matches nothing (FALSE); an unknown feature is an error.
#pragma once

#include "request.h"

#include <torch/custom_class.h>

#include <array>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace silverrec {

// The parsed filter. Flattened (prefix order) for Python as int64 triples [kind, n, position] (kinds: kernels/
// constants.py FILTER_NODE_*; n: a term's values, an AND / OR's children, 1 for NOT; position: where a term's
// feature name starts) and the strings (each term's feature, then its values).
struct FilterNode {
  int64_t kind = 0;
  int64_t position = 0;
  std::string feature;
  std::vector<std::string> values;  // a term's, de-duplicated in order
  std::vector<FilterNode> children;
};

// Parse a filter string (UTF-8; positions count characters as Python's str does). RequestError with Python's
// FilterSyntaxError message when it does not parse.
FilterNode parse_filter(const std::string& text);
void flatten_filter(const FilterNode& node, std::vector<int64_t>& nodes, std::vector<std::string>& strings);
FilterNode unflatten_filter(const std::vector<int64_t>& nodes, const std::vector<std::string>& strings);

// The `hashes` Bloom bit positions of token (feature, value) in [0, bits): keyed BLAKE2b (bloom_hash.py).
std::vector<int64_t> token_positions(const std::string& feature, const std::string& value, int64_t bits, int64_t hashes,
                                     uint64_t seed);

// One filter compiled: postfix instructions (opcode, signed rows) of the Bloom and the verify program, its posting
// lists (sorted ids and their total length; none: no posting-list superset) and its estimated matches.
struct CompiledFilter {
  std::vector<std::pair<int64_t, std::vector<int64_t>>> bloom, verify;
  std::optional<std::pair<std::vector<int64_t>, int64_t>> lists;
  double estimate = 0;
};

// The inputs of FilteredIVFIndex.forward for a batch of filters (filter_program.compile_request).
struct RequestPrograms {
  at::Tensor ops, rows, vops, vrows, lists;
};

class FilterCompiler : public torch::CustomClassHolder {
 public:
  // From the manifest's config["filter"]: Bloom bits M, hashes K, seed; rows of the bank; items in the pool; per
  // feature (names) its values (value_counts of them, flattened), exact planes (row, slots, bits; -1 row: none),
  // and per value its posting list id (-1: none), item count and bit-plane row (-1: none).
  FilterCompiler(int64_t bloom_bits, int64_t bloom_hashes, int64_t seed, int64_t total_rows, int64_t num_items,
                 std::vector<std::string> names, std::vector<int64_t> value_counts, std::vector<std::string> values,
                 std::vector<int64_t> exact, std::vector<int64_t> postings, std::vector<int64_t> counts,
                 std::vector<int64_t> planes);

  // One filter (text, or a parsed AST), compiled; strings are cached (LRU of kProgramCacheSize) unless use_cache is
  // false (benchmarks of the compile).
  std::shared_ptr<const CompiledFilter> compile(const std::string& text, bool use_cache = true) const;
  CompiledFilter compile(const FilterNode& node) const;
  // The batch's programs padded to common shapes; std::nullopt = no filter (TRUE, no posting lists). RequestError
  // for the first filter that does not compile.
  RequestPrograms request(const std::vector<std::optional<std::string>>& filters, bool use_cache = true) const;
  std::vector<double> estimates(const std::vector<std::optional<std::string>>& filters) const;
  int64_t num_items() const { return num_items_; }

  // The instructions of one program as tensors: ops int64 [L], rows int64 [L, T] (PUSH operands padded by their
  // first row, others 0) and each instruction's operand count int64 [L].
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> program_tensors(
      const std::vector<std::pair<int64_t, std::vector<int64_t>>>& prog);

  static constexpr size_t kProgramCacheSize = 4096;
  struct IR;  // the lowered form (filter_compiler.cpp)

 private:
  std::shared_ptr<IR> lower(const FilterNode& node, bool negated, bool exact_positive) const;
  std::optional<std::pair<std::vector<int64_t>, int64_t>> posting_lists(const FilterNode& node) const;
  double estimate(const FilterNode& node) const;
  int64_t feature_index(const std::string& name) const;  // -1 when unknown

  int64_t bits_, hashes_, total_rows_, num_items_;
  uint64_t seed_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, int64_t> name_index_;
  std::vector<std::unordered_map<std::string, int64_t>> vocab_;  // value -> index in the feature's vocabulary
  std::vector<std::vector<int64_t>> postings_, counts_, planes_;
  std::vector<std::array<int64_t, 3>> exact_;  // row, slots, bits (row -1: no planes)

  mutable std::mutex mutex_;  // the program cache's
  mutable std::list<std::pair<std::string, std::shared_ptr<const CompiledFilter>>> lru_;
  mutable std::unordered_map<std::string, decltype(lru_)::iterator> cached_;
};

}  // namespace silverrec
