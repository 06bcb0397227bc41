// The silverrec operator library (libsilverrec_ops.so): every silverrec:: schema, its CPU kernel and its Meta
// kernel (output shapes for torch.export and the compilers), and the silverrec_host:: functions (the
// predictor's request encoding and the kernels' controls and parts that tests call). No Python: a C++ process
// dlopens the library (or links it) and calls the ops through the dispatcher, as a TorchScript or AOTInductor
// program does; Python loads it with torch.ops.load_library (kernels/library.py), then registers the CUDA
// kernels (Triton) of the ops that have one.
//
// Each op's contract is documented in its kernels/<op>.py. A bad argument is a ValueError in Python (c10::ValueError;
// the kernels' std::invalid_argument becomes one here), an out-of-range row an IndexError.
#include <torch/library.h>

#include "constants.h"
#include "dot.h"
#include "filter_compiler.h"
#include "ops.h"
#include "request.h"
#include "team.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace silverrec {

namespace {

// F with std::invalid_argument (the kernels' bad values) rethrown as c10::ValueError, so that Python sees a
// ValueError and a C++ caller a c10::Error with the same message.
template <class Sig, Sig* F>
struct ValueErrors;
template <class R, class... Args, R (*F)(Args...)>
struct ValueErrors<R(Args...), F> {
  static R call(Args... args) {
    try {
      return F(std::forward<Args>(args)...);
    } catch (const std::invalid_argument& e) {
      C10_THROW_ERROR(ValueError, e.what());
    }
  }
};
#define CHECKED(f) TORCH_FN((&ValueErrors<decltype(f), &f>::call))

// The instruction set this build's kernels use: "avx512-vnni", "avx512" (AVX-512F without VNNI: the dot products
// take the AVX2 path, dot.h), "avx2" or "sse" (make test-portable checks each build is the one it claims).
std::string isa() {
#if SILVERREC_VNNI
  return "avx512-vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif SILVERREC_AVX2
  return "avx2";
#else
  return "sse";
#endif
}

void set_team_pin_op(int64_t pin) { set_team_pin(int(pin)); }

// The filter functions for Python return their error as a value, the last element of their result ("": none): a
// filter's message may hold a NUL byte (a template's placeholders), where an exception's message would stop.
// On an error the values are `none` (tensors: empty ones, an undefined tensor cannot reach Python).
template <class R, class F>
auto or_error(F&& f, R none = R()) -> decltype(std::tuple_cat(f(), std::make_tuple(std::string()))) {
  try {
    return std::tuple_cat(f(), std::make_tuple(std::string()));
  } catch (const RequestError& e) {
    return std::tuple_cat(std::move(none), std::make_tuple(e.message));
  }
}

at::Tensor no_tensor() { return at::empty({0}, at::kLong); }

// silverrec_host.parse_filter: a filter string's AST, flattened (filter_compiler.h FilterNode)
std::tuple<std::vector<int64_t>, std::vector<std::string>, std::string> parse_filter_op(std::string text) {
  using R = std::tuple<std::vector<int64_t>, std::vector<std::string>>;
  return or_error<R>([&] {
    R out;
    flatten_filter(parse_filter(text), std::get<0>(out), std::get<1>(out));
    return out;
  });
}

// silverrec_host.token_positions: the seed as Python's unsigned 64-bit int, passed as its two's complement
std::vector<int64_t> token_positions_op(std::string feature, std::string value, int64_t bits, int64_t hashes,
                                        int64_t seed) {
  return token_positions(feature, value, bits, hashes, uint64_t(seed));
}

// Filters given as strings with a flag each (present[b] == 0: no filter), as std::optional.
std::vector<std::optional<std::string>> optional_filters(std::vector<std::string> texts, const std::vector<int64_t>& present) {
  TORCH_CHECK_VALUE(texts.size() == present.size(), "FilterCompiler: one presence flag per filter");
  std::vector<std::optional<std::string>> out;
  for (size_t b = 0; b < texts.size(); ++b) out.push_back(present[b] ? std::optional<std::string>(std::move(texts[b])) : std::nullopt);
  return out;
}

using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Compiler = c10::intrusive_ptr<FilterCompiler>;

// silverrec::centroid_candidates: the int8 screen on (the host function's screen=False scores every centroid)
at::Tensor centroid_candidates_screened(const at::Tensor& queries, const at::Tensor& centroids, int64_t P) {
  return centroid_candidates_op(queries, centroids, P, true);
}

// ---- Meta kernels: the outputs' shapes and dtypes (sizes may be symbolic under torch.export)
using c10::SymInt;
using Pair = std::tuple<at::Tensor, at::Tensor>;

at::Tensor meta(c10::SymIntArrayRef sizes, const at::Tensor& like, at::ScalarType dtype) {
  return at::empty_symint(sizes, like.options().dtype(dtype));
}

Pair scores_rows(const at::Tensor& like, const SymInt& B, const SymInt& k) {
  return {meta({B, k}, like, at::kFloat), meta({B, k}, like, at::kLong)};
}

Pair ivf_scan_meta(const at::Tensor& queries, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, SymInt k, const std::optional<at::Tensor>&, SymInt, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&) {
  return scores_rows(queries, queries.sym_size(0), k);
}

Pair filtered_topk_meta(const at::Tensor& queries, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, at::TensorList, at::TensorList, const at::Tensor&, SymInt k, SymInt,
                        at::TensorList) {
  return scores_rows(queries, queries.sym_size(0), k);
}

at::Tensor bloom_filter_meta(const at::Tensor& bits, const at::Tensor&, const at::Tensor&, const at::Tensor& word_start,
                             SymInt n_words) {
  return meta({word_start.sym_size(0), word_start.sym_size(1), n_words}, bits, at::kLong);
}

Pair bloom_filter_counts_meta(const at::Tensor& bits, const at::Tensor&, const at::Tensor&, const at::Tensor& lo,
                              const at::Tensor&, SymInt n_words) {
  return {meta({lo.sym_size(0), lo.sym_size(1), n_words}, bits, at::kLong), meta({lo.sym_size(0), lo.sym_size(1)}, bits, at::kLong)};
}

Pair verify_topk_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor& scores,
                      const at::Tensor& rows, SymInt k) {
  return {meta({rows.sym_size(0), k}, scores, at::kFloat), meta({rows.sym_size(0), k}, rows, at::kLong)};
}

at::Tensor centroid_candidates_meta(const at::Tensor& queries, const at::Tensor&, SymInt P) {
  return meta({queries.sym_size(0), P}, queries, at::kLong);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> filter_plan_meta(const at::Tensor& queries, at::TensorList,
                                                                c10::SymIntArrayRef params, double, at::TensorList,
                                                                const at::Tensor&, SymInt, SymInt, SymInt max_probe) {
  TORCH_CHECK_VALUE(int64_t(params.size()) == filtered_ivf_params::kCount, "filter_plan: params must hold ",
                    filtered_ivf_params::kCount, " entries, got ", params.size());
  const SymInt B = queries.sym_size(0);
  return {meta({B, max_probe}, queries, at::kLong), meta({B, max_probe, params[ivf_params::kWindowWords]}, queries, at::kLong),
          meta({B}, queries, at::kLong)};
}

Pair filtered_ivf_search_meta(const at::Tensor& queries, at::TensorList, at::IntArrayRef, double, at::TensorList,
                              const at::Tensor&, SymInt k, SymInt, SymInt, SymInt, int64_t) {
  return scores_rows(queries, queries.sym_size(0), k);
}

Pair ivf_search_meta(const at::Tensor& queries, at::TensorList, at::IntArrayRef, SymInt k, SymInt, SymInt, int64_t) {
  return scores_rows(queries, queries.sym_size(0), k);
}

Pair rescore_rows_meta(const at::Tensor& queries, const at::Tensor& found, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, SymInt k, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  return scores_rows(queries, found.sym_size(0), k);
}

at::Tensor candidate_rows_meta(const at::Tensor&, const at::Tensor& found, const at::Tensor& exclude, const at::Tensor&,
                               SymInt, SymInt limit, bool) {
  return meta({exclude.sym_size(0), limit}, found, at::kLong);
}

at::Tensor mol_score_meta(const at::Tensor& user, const at::Tensor& rows, const at::Tensor&, const at::Tensor&,
                          at::TensorList, at::IntArrayRef) {
  return meta({rows.sym_size(0), rows.sym_size(1), user.sym_size(1)}, user, at::kFloat);
}

at::Tensor rows_to_items_meta(const at::Tensor&, const at::Tensor& rows) { return meta(rows.sym_sizes(), rows, at::kLong); }

Pair merge_attention_states_meta(const at::Tensor& v_a, const at::Tensor& s_a, const at::Tensor&, const at::Tensor&) {
  return {at::empty_like(v_a), at::empty_like(s_a)};
}

at::Tensor staged_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, SymInt) {
  return at::empty_like(q);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> beam_topk_meta(const at::Tensor&, const at::Tensor& logprobs, SymInt,
                                                              SymInt beam_width) {
  const SymInt B = logprobs.sym_size(0);
  return {meta({B, beam_width}, logprobs, logprobs.scalar_type()), meta({B, beam_width}, logprobs, at::kLong),
          meta({B, beam_width}, logprobs, at::kLong)};
}

}  // namespace

}  // namespace silverrec

// The model operators. Schemas take at most 12 arguments (tests/test_kernel_interfaces.py); the index and the
// request's programs travel as lists in the layouts kernels/constants.py defines (csrc/search_args.h).
TORCH_LIBRARY(silverrec, m) {
  m.def("ivf_search(Tensor queries, Tensor[] index, int[] params, SymInt k, SymInt nprobe, SymInt rescore_margin=0, "
        "int rescore_max_k=0) -> (Tensor, Tensor)");
  m.def("filtered_ivf_search(Tensor queries, Tensor[] index, int[] params, float exact_cost_ratio, Tensor[] program, "
        "Tensor mode, SymInt k, SymInt nprobe, SymInt max_probe, SymInt rescore_margin=0, int rescore_max_k=0) -> "
        "(Tensor, Tensor)");
  m.def("ivf_scan(Tensor queries, Tensor codes, Tensor scale, Tensor offset, Tensor cluster_offsets, Tensor probes, "
        "SymInt k, Tensor? bitmask=None, SymInt window_words=0, Tensor? centroids=None, Tensor? centroid_queries=None) "
        "-> (Tensor, Tensor)");
  m.def("centroid_candidates(Tensor queries, Tensor centroids, SymInt P) -> Tensor");
  m.def("filter_plan(Tensor queries, Tensor[] index, SymInt[] params, float exact_cost_ratio, Tensor[] program, "
        "Tensor mode, SymInt k, SymInt nprobe, SymInt max_probe) -> (Tensor, Tensor, Tensor)");
  m.def("bloom_filter(Tensor bits, Tensor ops, Tensor rows, Tensor word_start, SymInt n_words) -> Tensor");
  m.def("bloom_filter_counts(Tensor bits, Tensor ops, Tensor rows, Tensor lo, Tensor hi, SymInt n_words) -> "
        "(Tensor, Tensor)");
  m.def("verify_topk(Tensor bits, Tensor ops, Tensor prog_rows, Tensor scores_in, Tensor rows_in, SymInt k) -> "
        "(Tensor, Tensor)");
  m.def("filtered_topk(Tensor queries, Tensor codes, Tensor scale, Tensor offset, Tensor bits, Tensor[] program, "
        "Tensor[] postings, Tensor active, SymInt k, SymInt max_candidates, Tensor[] residual) -> (Tensor, Tensor)");
  m.def("rescore_rows(Tensor queries, Tensor found, Tensor codes, Tensor dim_scale, Tensor dim_offset, SymInt k, "
        "Tensor? cluster_offsets=None, Tensor? centroids=None) -> (Tensor, Tensor)");
  m.def("rows_to_items(Tensor row_to_item, Tensor rows) -> Tensor");
  m.def("candidate_rows(Tensor queries, Tensor found, Tensor exclude, Tensor emb, SymInt k0, SymInt limit, "
        "bool intersection) -> Tensor");
  m.def("mol_score(Tensor user, Tensor rows, Tensor emb, Tensor ranker, Tensor[] weights, int[] dims) -> Tensor");
  m.def("merge_attention_states(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b) -> (Tensor, Tensor)");
  m.def("staged_attention(Tensor q, Tensor shared_k, Tensor shared_v, Tensor key_valid, Tensor unshared_k, "
        "Tensor unshared_v, SymInt n_unshared) -> Tensor");
  m.def("beam_topk(Tensor beam_scores, Tensor logprobs, SymInt top_k, SymInt beam_width) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(silverrec, CPU, m) {
  using namespace silverrec;
  m.impl("ivf_search", CHECKED(ivf_search));
  m.impl("filtered_ivf_search", CHECKED(filtered_ivf_search));
  m.impl("ivf_scan", CHECKED(ivf_scan));
  m.impl("centroid_candidates", CHECKED(centroid_candidates_screened));
  m.impl("filter_plan", CHECKED(filter_plan_op));
  m.impl("bloom_filter", CHECKED(bloom_filter_op));
  m.impl("bloom_filter_counts", CHECKED(bloom_filter_counts_op));
  m.impl("verify_topk", CHECKED(verify_topk_op));
  m.impl("filtered_topk", CHECKED(filtered_topk));
  m.impl("rescore_rows", CHECKED(rescore_rows));
  m.impl("rows_to_items", CHECKED(rows_to_items));
  m.impl("candidate_rows", CHECKED(candidate_rows));
  m.impl("mol_score", CHECKED(mol_score));
  m.impl("merge_attention_states", CHECKED(merge_attention_states));
  m.impl("staged_attention", CHECKED(staged_attention));
  m.impl("beam_topk", CHECKED(beam_topk));
}

TORCH_LIBRARY_IMPL(silverrec, Meta, m) {
  using namespace silverrec;
  m.impl("ivf_search", TORCH_FN(ivf_search_meta));
  m.impl("filtered_ivf_search", TORCH_FN(filtered_ivf_search_meta));
  m.impl("ivf_scan", TORCH_FN(ivf_scan_meta));
  m.impl("centroid_candidates", TORCH_FN(centroid_candidates_meta));
  m.impl("filter_plan", TORCH_FN(filter_plan_meta));
  m.impl("bloom_filter", TORCH_FN(bloom_filter_meta));
  m.impl("bloom_filter_counts", TORCH_FN(bloom_filter_counts_meta));
  m.impl("verify_topk", TORCH_FN(verify_topk_meta));
  m.impl("filtered_topk", TORCH_FN(filtered_topk_meta));
  m.impl("rescore_rows", TORCH_FN(rescore_rows_meta));
  m.impl("rows_to_items", TORCH_FN(rows_to_items_meta));
  m.impl("candidate_rows", TORCH_FN(candidate_rows_meta));
  m.impl("mol_score", TORCH_FN(mol_score_meta));
  m.impl("merge_attention_states", TORCH_FN(merge_attention_states_meta));
  m.impl("staged_attention", TORCH_FN(staged_attention_meta));
  m.impl("beam_topk", TORCH_FN(beam_topk_meta));
}

// The CUDA kernels written as ATen calls (the Triton ones are registered from Python: kernels/*.py).
TORCH_LIBRARY_IMPL(silverrec, CUDA, m) {
  using namespace silverrec;
  m.impl("beam_topk", CHECKED(beam_topk_every_beam));
}

// Host functions: not model ops (no program calls them), plain C++ that Python reaches through the dispatcher.
TORCH_LIBRARY(silverrec_host, m) {
  using namespace silverrec;
  // the predictor's request encoding (kernels/csrc/encode.cpp)
  m.def("encode_histories(Tensor rows, Tensor offsets, int exclude_limit, int history_len, int recent_len, "
        "Tensor[] feature_offsets, Tensor[] feature_codes, int num_items) -> (Tensor, Tensor, Tensor)",
        CHECKED(encode_histories));
  m.def("lookup_ids(int[] ids, int[] sizes, Tensor table) -> (Tensor, Tensor, int)", CHECKED(lookup_ids));
  // a recommendation snapshot's whole request encoding (request.h): a bad request is a ValueError with its message
  m.class_<RecEncoder>("RecEncoder")
      .def(torch::init<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, bool, at::Tensor, at::Tensor,
                       at::Tensor, std::vector<std::string>, std::vector<std::string>, std::vector<int64_t>,
                       std::vector<std::string>, std::vector<double>, std::vector<double>, int64_t, int64_t>())
      .def("encode",
           [](const c10::intrusive_ptr<RecEncoder>& self, std::vector<int64_t> user_ids, std::vector<int64_t> given,
              std::vector<int64_t> ids, std::vector<int64_t> sizes, std::vector<std::string> feature_keys,
              std::vector<int64_t> key_counts, std::vector<std::string> feature_values, std::vector<int64_t> value_counts,
              std::vector<std::string> numeric_keys, std::vector<double> numeric_values,
              std::vector<int64_t> numeric_counts, bool exclude_history, int64_t exclude_limit) {
             try {
               return self->encode_flat(std::move(user_ids), std::move(given), std::move(ids), std::move(sizes),
                                        std::move(feature_keys), std::move(key_counts), std::move(feature_values),
                                        std::move(value_counts), std::move(numeric_keys), std::move(numeric_values),
                                        std::move(numeric_counts), exclude_history, exclude_limit);
             } catch (const RequestError& e) {
               C10_THROW_ERROR(ValueError, e.what());
             }
           })
      .def("rows", [](const c10::intrusive_ptr<RecEncoder>& self, std::vector<int64_t> ids, std::string where) {
        try {
          return self->rows_op(std::move(ids), std::move(where));
        } catch (const RequestError& e) {
          C10_THROW_ERROR(ValueError, e.what());
        }
      });
  // the filter language (filter_compiler.h): a filter that does not parse or compile is a ValueError with its message
  m.def("parse_filter(str text) -> (int[], str[], str)", CHECKED(parse_filter_op));
  m.def("token_positions(str feature, str value, int bits, int hashes, int seed) -> int[]", CHECKED(token_positions_op));
  m.class_<FilterCompiler>("FilterCompiler")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<std::string>, std::vector<int64_t>,
                       std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<int64_t>>())
      .def("program", [](const Compiler& self, std::string text, bool verify) {
        return or_error<Tensors3>([&] {
          const auto p = self->compile(text);
          return FilterCompiler::program_tensors(verify ? p->verify : p->bloom);
        }, {no_tensor(), no_tensor(), no_tensor()});
      })
      .def("program_ast", [](const Compiler& self, std::vector<int64_t> nodes, std::vector<std::string> strings,
                             bool verify) {
        return or_error<Tensors3>([&] {
          const CompiledFilter p = self->compile(unflatten_filter(nodes, strings));
          return FilterCompiler::program_tensors(verify ? p.verify : p.bloom);
        }, {no_tensor(), no_tensor(), no_tensor()});
      })
      .def("lists_ast", [](const Compiler& self, std::vector<int64_t> nodes, std::vector<std::string> strings) {
        using R = std::tuple<std::vector<int64_t>, int64_t, bool>;
        return or_error<R>([&] {
          const CompiledFilter p = self->compile(unflatten_filter(nodes, strings));
          return p.lists ? R(p.lists->first, p.lists->second, true) : R({}, 0, false);
        });
      })
      .def("request", [](const Compiler& self, std::vector<std::string> texts, std::vector<int64_t> present,
                         bool use_cache) {
        using R = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
        return or_error<R>([&] {
          const RequestPrograms r = self->request(optional_filters(std::move(texts), present), use_cache);
          return R(r.ops, r.rows, r.vops, r.vrows, r.lists);
        }, {no_tensor(), no_tensor(), no_tensor(), no_tensor(), no_tensor()});
      })
      .def("estimates", [](const Compiler& self, std::vector<std::string> texts, std::vector<int64_t> present) {
        return or_error<std::tuple<std::vector<double>>>(
            [&] { return std::make_tuple(self->estimates(optional_filters(std::move(texts), present))); });
      });
  // the kernels' parts, for tests and benchmarks
  m.def("ivf_scan_keys(Tensor qcodes, Tensor codes, Tensor cluster_offsets, Tensor probes, Tensor? bitmask, int k, "
        "Tensor? bias=None) -> Tensor", CHECKED(ivf_scan_keys_op));
  m.def("quantize_queries(Tensor queries) -> (Tensor, Tensor)", CHECKED(quantize_queries));
  m.def("keys_to_results(Tensor keys, Tensor qscale, Tensor qsum, Tensor scale, Tensor offset) -> (Tensor, Tensor)",
        CHECKED(keys_to_results));
  m.def("centroid_candidates(Tensor queries, Tensor centroids, int P, bool screen=True) -> Tensor",
        CHECKED(centroid_candidates_op));
  m.def("beam_topk_every_beam(Tensor beam_scores, Tensor logprobs, int top_k, int beam_width) -> "
        "(Tensor, Tensor, Tensor)", CHECKED(beam_topk_every_beam));
  // the build and its parallel steps' runner (team.h)
  m.def("isa() -> str", &isa);
  m.def("set_team_pin(int pin) -> ()", &set_team_pin_op);
  m.def("parallel_runner() -> str", &parallel_runner);
  m.def("team_helper_chunks() -> int", &team_helper_chunks);
  m.def("team_probe(int n, int grain, int throw_at=-1) -> int[]", CHECKED(team_probe));
}
