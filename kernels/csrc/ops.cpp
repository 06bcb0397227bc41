// Python bindings of the CPU fast paths (module silverrec.kernels._cpu).
//
// Each function turns one op's arguments into scan segments (scan.h) and returns int64 sort keys;
// the Python custom ops (kernels/*.py) quantise queries and dequantise scores around them. Bad
// values raise ValueError (std::invalid_argument) with the same messages as the torch paths.
#include <torch/library.h>
#include <torch/python.h>

#include "tensor.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <optional>
#include <tuple>
#include <stdexcept>
#include <string>

#include "constants.h"
#include "dot.h"
#include "program.h"
#include "results.h"
#include "scan.h"
#include "search_args.h"
#include "team.h"
#include "topk_state.h"
#include "widen.h"

namespace silverrec {

// kernels/csrc/encode.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_histories(
    const at::Tensor& rows, const at::Tensor& offsets, int64_t exclude_limit, int64_t history_len, int64_t recent_len,
    const std::vector<at::Tensor>& feature_offsets, const std::vector<at::Tensor>& feature_codes, int64_t num_items);
std::tuple<at::Tensor, at::Tensor, int64_t> lookup_ids(const std::vector<std::vector<int64_t>>& lists,
                                                       const at::Tensor& table);

namespace {

ScanInput base_input(const at::Tensor& qcodes, const at::Tensor& codes, int64_t k) {
  check(qcodes, at::kChar, 2, "qcodes");
  check(codes, at::kChar, 2, "codes");
  TORCH_CHECK(qcodes.size(1) == codes.size(1), "qcodes and codes disagree on D");
  ScanInput in;
  in.qcodes = qcodes.data_ptr<int8_t>();
  in.codes = codes.data_ptr<int8_t>();
  in.B = qcodes.size(0);
  in.D = codes.size(1);
  in.N = codes.size(0);
  in.k = k;
  return in;
}

}  // namespace

// ivf_scan: probes [B, P] (-1 = empty slot, repeats of a cluster count once: the first slot), optional
// bitmask [B, P, Wc]. Segments = probed clusters, ordered by the best slot any query gave them.
at::Tensor ivf_scan_keys(const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& cluster_offsets,
                         const at::Tensor& probes, const std::optional<at::Tensor>& bitmask, int64_t k,
                         const BiasTable& table, const ClusterTerm& term) {
  ScanInput in = base_input(qcodes, codes, k);
  check(cluster_offsets, at::kLong, 1, "cluster_offsets");
  check(probes, at::kLong, 2, "probes");
  const int64_t nlist = cluster_offsets.size(0) - 1, P = probes.size(1);
  TORCH_CHECK(nlist >= 1 && probes.size(0) == in.B, "bad cluster_offsets / probes shape");
  const int64_t* off = cluster_offsets.data_ptr<int64_t>();
  const int64_t* pr = probes.data_ptr<int64_t>();
  bool rising = off[0] == 0 && off[nlist] == in.N;
  int64_t wc = 0;  // words per slot the index needs (kernels/ivf_scan.py bitmask_words)
  for (int64_t c = 0; c < nlist; ++c) {
    rising &= off[c + 1] >= off[c];
    wc = std::max(wc, ((off[c + 1] + 63) >> 6) - (off[c] >> 6));
  }
  if (!rising) throw std::invalid_argument("cluster_offsets must rise from 0 to N=" + std::to_string(in.N));
  for (int64_t i = 0; i < in.B * P; ++i)
    if (pr[i] < -1 || pr[i] >= nlist)
      throw std::invalid_argument("probes must hold cluster ids in [0, " + std::to_string(nlist) + ") or -1");
  int64_t wslot = 0;
  if (bitmask) {
    check(*bitmask, at::kLong, 3, "bitmask");
    TORCH_CHECK(bitmask->size(0) == in.B && bitmask->size(1) == P, "bitmask must be [B, P, Wc]");
    wslot = bitmask->size(2);
    if (wslot < wc)
      throw std::invalid_argument("bitmask has " + std::to_string(wslot) + " words per slot, the index needs " +
                                  std::to_string(wc));
    in.bitmask = bitmask->data_ptr<int64_t>();
  }
  // residual codes: a caller's bias table, or the cluster term of each query's probed clusters (ClusterTerm)
  std::vector<float> probe_score, best(in.B, 0.0f);
  if (term.centroids) {
    probe_score.assign(in.B * P, 0.0f);
    for (int64_t b = 0; b < in.B; ++b) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < P; ++j) {
        const int64_t c = pr[b * P + j];
        if (c < 0) continue;
        probe_score[b * P + j] = dot_lanes_f32(term.queries + b * in.D, term.centroids + c * in.D, in.D);
        top = std::max(top, probe_score[b * P + j]);
        if (term.scores) term.scores[c * in.B + b] = probe_score[b * P + j];
      }
      best[b] = top > -std::numeric_limits<float>::infinity() ? top : 0.0f;
      term.shift[b] = shift_back(best[b], term.unit[b]);
    }
  }
  const bool biased = bool(table) || term.centroids;
  // First slot of each (query, cluster); count members per cluster and each cluster's best slot.
  std::vector<int64_t> last_query(nlist, -1), count(nlist, 0), best_slot(nlist, P);
  std::vector<int64_t> first_slot(in.B * P, -1);  // slot j of query b if it is the first for its cluster
  for (int64_t b = 0; b < in.B; ++b)
    for (int64_t j = 0; j < P; ++j) {
      const int64_t c = pr[b * P + j];
      if (c < 0 || last_query[c] == b) continue;
      last_query[c] = b;
      if (off[c + 1] == off[c]) continue;  // empty cluster: nothing to scan
      first_slot[b * P + j] = j;
      ++count[c];
      best_slot[c] = std::min(best_slot[c], j);
    }
  std::vector<int64_t> order;
  for (int64_t c = 0; c < nlist; ++c)
    if (count[c]) order.push_back(c);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return best_slot[x] < best_slot[y]; });
  std::vector<int64_t> cursor(nlist, 0);
  int64_t m = 0;
  for (int64_t c : order) {
    in.segments.push_back({off[c], off[c + 1], m, count[c]});
    cursor[c] = m;
    m += count[c];
  }
  in.member_query.assign(m, 0);
  in.member_word.assign(m, 0);
  if (biased) in.member_bias.assign(m, 0);
  for (int64_t b = 0; b < in.B; ++b)
    for (int64_t j = 0; j < P; ++j) {
      if (first_slot[b * P + j] < 0) continue;
      const int64_t c = pr[b * P + j], i = cursor[c]++;
      in.member_query[i] = b;
      in.member_word[i] = (b * P + j) * wslot - (off[c] >> 6);
      if (table) in.member_bias[i] = table(b, c);  // residual codes: dot + bias[b, c]
      else if (biased) in.member_bias[i] = cluster_bias(probe_score[b * P + j], best[b], term.unit[b]);
    }
  return scan_topk(in);
}

// kernels/common.py quantize_queries, bit for bit: scale = max(amax |q|, kQueryScaleFloor) / kQueryCodeMax and
// codes = round-half-even(q / scale) clamped to [-kQueryCodeMax, kQueryCodeMax] (float32 throughout).
std::tuple<at::Tensor, at::Tensor> quantize_queries(const at::Tensor& queries) {
  TORCH_CHECK(queries.device().is_cpu() && queries.scalar_type() == at::kFloat && queries.dim() == 2 &&
                  queries.is_contiguous(), "quantize_queries: contiguous float32 [B, D] expected");
  constexpr float kScaleFloor = float(kQueryScaleFloor), kCodeMax = float(kQueryCodeMax);
  static_assert(kScaleFloor == 1e-30f, "kQueryScaleFloor: the float nearest its decimal value");
  const int64_t B = queries.size(0), D = queries.size(1);
  at::Tensor codes = at::empty({B, D}, at::kChar), scale = at::empty({B}, at::kFloat);
  const float* q = queries.data_ptr<float>();
  int8_t* c = codes.data_ptr<int8_t>();
  float* s = scale.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float* x = q + b * D;
    float m = 0.0f;
    for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(x[d]));
    const float sc = std::max(m, kScaleFloor) / kCodeMax;
    s[b] = sc;
    for (int64_t d = 0; d < D; ++d) c[b * D + d] = int8_t(std::min(kCodeMax, std::max(-kCodeMax, std::nearbyint(x[d] / sc))));
  }
  return {codes, scale};
}

std::tuple<at::Tensor, at::Tensor> keys_to_results(const at::Tensor& keys, const at::Tensor& qscale,
                                                   const at::Tensor& qsum, const at::Tensor& scale,
                                                   const at::Tensor& offset) {
  check(keys, at::kLong, 2, "keys");
  check(qscale, at::kFloat, 1, "qscale");
  check(qsum, at::kFloat, 1, "qsum");
  const int64_t B = keys.size(0);
  TORCH_CHECK(qscale.size(0) == B && qsum.size(0) == B, "qscale / qsum must have B entries");
  return decode_keys(keys, qscale.data_ptr<float>(), qsum.data_ptr<float>(), scale.item<float>(), offset.item<float>());
}

namespace {

// o[i] = id[r[i]] as int64, -1 where r[i] < 0; a row >= n is an IndexError. A run of padding (the
// tail of a selective search's rows at large k) is one fill: no per-element check or gather.
template <typename Id>
void map_rows(const Id* id, int64_t n, const int64_t* r, int64_t m, int64_t* o) {
  for (int64_t i = 0; i < m;) {
    if (r[i] < 0) {
      int64_t j = i + 1;
#if defined(__AVX2__)
      // 4 rows per step while all are negative (their sign bits)
      while (j + 4 <= m && _mm256_movemask_pd(_mm256_castsi256_pd(
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + j)))) == 0xF)
        j += 4;
#endif
      while (j < m && r[j] < 0) ++j;
      std::fill(o + i, o + j, int64_t{-1});
      i = j;
      continue;
    }
    TORCH_CHECK_INDEX(r[i] < n, "rows_to_items: row ", r[i], " out of range for ", n, " rows");
    o[i] = int64_t(id[r[i]]);
    ++i;
  }
}

}  // namespace

// silverrec::rows_to_items (kernels/rows_to_items.py): row_to_item int32/int64 [N], rows int64 (any
// shape, -1 = none) -> item ids int64, -1 kept; one pass instead of clamp / index / cast / where.
at::Tensor rows_to_items(const at::Tensor& row_to_item_in, const at::Tensor& rows_in) {
  const at::Tensor map = row_to_item_in.contiguous(), rows = rows_in.contiguous();
  TORCH_CHECK(map.dim() == 1 && (map.scalar_type() == at::kInt || map.scalar_type() == at::kLong),
              "rows_to_items: row_to_item must be int32 or int64 [N], got ", map.scalar_type(), " ", map.sizes());
  TORCH_CHECK(rows.scalar_type() == at::kLong, "rows_to_items: rows must be int64, got ", rows.scalar_type());
  at::Tensor out = at::empty(rows.sizes(), at::kLong);
  const int64_t n = map.size(0), m = rows.numel();
  const int64_t* r = rows.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  if (map.scalar_type() == at::kInt) map_rows(map.data_ptr<int32_t>(), n, r, m, o);
  else map_rows(map.data_ptr<int64_t>(), n, r, m, o);
  return out;
}

}  // namespace silverrec

// The CPU kernel of silverrec::rows_to_items, registered with the dispatcher (the op, its fake and CUDA kernel
// are defined in kernels/rows_to_items.py, imported before this library is loaded).
TORCH_LIBRARY_IMPL(silverrec, CPU, m) { m.impl("rows_to_items", &silverrec::rows_to_items); }

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace silverrec;
  m.doc() = "silverrec CPU fast paths: fused int8 scan + bitmask + top-k, bloom filter programs";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("ivf_scan_keys", [](const at::Tensor& qcodes, const at::Tensor& codes, const at::Tensor& cluster_offsets,
                            const at::Tensor& probes, const std::optional<at::Tensor>& bitmask, int64_t k,
                            const std::optional<at::Tensor>& bias) {
          return ivf_scan_keys(qcodes, codes, cluster_offsets, probes, bitmask, k,
                               bias_table(bias, qcodes.size(0), cluster_offsets.size(0) - 1), ClusterTerm{});
        }, "top-k keys over probed clusters", py::arg("qcodes"), py::arg("codes"),
        py::arg("cluster_offsets"), py::arg("probes"), py::arg("bitmask"), py::arg("k"), py::arg("bias") = py::none(),
        nogil);
  m.def("quantize_queries", &quantize_queries, "per-query symmetric int8 codes and scales (common.py, bit for bit)",
        py::arg("queries"), nogil);
  m.def("set_team_pin", &silverrec::set_team_pin,
        "tests: -1 the team under OMP_WAIT_POLICY=PASSIVE, else OpenMP; 0 every step on the calling thread; "
        "1 the team, each step of several chunks waiting for a helper to take one; 2 OpenMP (team.h)", py::arg("pin"));
  m.def("parallel_runner", &silverrec::parallel_runner, "who runs the ops' parallel steps: team, openmp or alone");
  m.def("team_helper_chunks", &silverrec::team_helper_chunks, "chunks of the ops' steps run on helper threads so far");
  m.def("centroid_candidates", [](const at::Tensor& queries, const at::Tensor& centroids, int64_t P, bool screen) {
          TeamCall team;  // the helpers wake once for the call's steps
          const at::Tensor c = centroids.contiguous(), q = queries.contiguous();
          at::Tensor out = at::empty({q.size(0), P}, at::kLong);
          std::vector<int64_t> all(q.size(0));
          std::iota(all.begin(), all.end(), int64_t{0});
          centroid_candidates(c, q, P, all, out.data_ptr<int64_t>(), screen);
          return out;
        }, "each query's best P centroids int64 [B, P] as filter_plan picks them (centroid_probe.cpp); screen "
        "false: every score computed", py::arg("queries"), py::arg("centroids"), py::arg("P"), py::arg("screen") = true, nogil);
  m.def("team_probe", &silverrec::team_probe, "tests: the thread that ran each index of a team_for (team.h)",
        py::arg("n"), py::arg("grain"), py::arg("throw_at") = -1, nogil);
  m.def("isa", &isa, "the instruction set of this build's kernels (avx512-vnni, avx512, avx2, sse)");
  m.def("keys_to_results", &keys_to_results, "keys -> (scores float32, rows int64), -inf / -1 padding",
        py::arg("keys"), py::arg("qscale"), py::arg("qsum"), py::arg("scale"), py::arg("offset"), nogil);
  m.def("bloom_filter", &silverrec::bloom_filter, "filter programs over word windows -> int64 [B, P, n_words]",
        py::arg("bits"), py::arg("ops"), py::arg("rows"), py::arg("word_start"), py::arg("n_words"), nogil);
  m.def("bloom_filter_counts", &silverrec::bloom_filter_counts,
        "filter programs over row ranges [lo, hi) -> (int64 [B, P, n_words] mask, int64 [B, P] counts)",
        py::arg("bits"), py::arg("ops"), py::arg("rows"), py::arg("lo"), py::arg("hi"), py::arg("n_words"), nogil);
  m.def("verify_topk", &silverrec::verify_topk, "first k ranked entries whose row passes the program",
        py::arg("bits"), py::arg("ops"), py::arg("rows"), py::arg("scores"), py::arg("result_rows"), py::arg("k"), nogil);
  m.def("filtered_topk_keys", &silverrec::filtered_topk_keys,
        "top-k keys over rows passing the program, from posting lists or the whole pool", py::arg("qcodes"),
        py::arg("codes"), py::arg("bits"), py::arg("ops"), py::arg("rows"), py::arg("post_rows"),
        py::arg("post_offsets"), py::arg("lists"), py::arg("active"), py::arg("k"),
        py::arg("cluster_offsets") = py::none(), py::arg("centroids") = py::none(),
        py::arg("centroid_queries") = py::none(), py::arg("unit") = py::none(), nogil);
  m.def("filter_plan", [](const at::Tensor& queries, const std::vector<at::Tensor>& index,
                          const std::vector<int64_t>& params, double exact_cost_ratio,
                          const std::vector<at::Tensor>& program, const at::Tensor& mode, int64_t k, int64_t nprobe,
                          int64_t max_probe) {
          const char* op = "filter_plan";
          const FilterIndex fx = filter_index(op, index, params, exact_cost_ratio);
          return silverrec::filter_plan(queries, ivf_index(index, params), fx, request_program(op, program), mode, k,
                                        nprobe, max_probe);
        }, "filtered IVF routing: (probes, bitmask, route); the op's arguments (kernels/filter_plan.py)",
        py::arg("queries"), py::arg("index"), py::arg("params"), py::arg("exact_cost_ratio"), py::arg("program"),
        py::arg("mode"), py::arg("k"), py::arg("nprobe"), py::arg("max_probe"), nogil);
  m.def("lookup_ids", &silverrec::lookup_ids, "id lists -> (rows int64, offsets int64, first list with an unknown id or -1)",
        py::arg("lists"), py::arg("table"));
  m.def("encode_histories", &silverrec::encode_histories,
        "history rows -> (exclusions [B, E], the user tower's item-key values, lengths)", py::arg("rows"),
        py::arg("offsets"), py::arg("exclude_limit"), py::arg("history_len"), py::arg("recent_len"),
        py::arg("feature_offsets"), py::arg("feature_codes"), py::arg("num_items"), nogil);
  m.attr("vnni") = py::bool_(
#if defined(__AVX512VNNI__)
      true
#else
      false
#endif
  );
}
