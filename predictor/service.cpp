// Requests validated and answered (service.h). The checks and messages are silverrec/serving/served.py's (400) and,
// for a body of the wrong shape, the gist of the pydantic models' (422); the encoding is RecEncoder's (request.h).
#include "service.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/sort.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "constants.h"

namespace silverrec {

namespace {

constexpr int64_t kMaxQueryRows = 1024;  // served.py MAX_QUERY_ROWS
constexpr int64_t kMaxRankItems = 1 << 20;  // recommend.py MAX_RANK_ITEMS
constexpr int64_t kMaxListwiseRankItems = 4096;  // recommend.py MAX_LISTWISE_RANK_ITEMS
const char* const kUserFields[] = {"user_id", "history", "features", "numeric", "filter", "exclude"};
const std::map<std::string, int64_t> kModes = {{"auto", kModeAuto}, {"probed", kModeProbed}, {"unprobed", kModeUnprobed}};
const char* const kSources[] = {"ann", "generative"};  // silverrec/generative/source.py SOURCES

[[noreturn]] void bad(const std::string& message) { throw BadRequest(400, message); }
[[noreturn]] void invalid(const std::string& where, const std::string& message) {
  throw BadRequest(422, "invalid request: " + where + ": " + message);
}

std::string loc(const std::string& base, const std::string& field) { return base.empty() ? field : base + "." + field; }

// ---- the pydantic models' field types (strict: no coercion)
void allow_fields(const Json& body, const std::vector<std::string>& fields, const std::string& where) {
  if (!body.is_object()) invalid(where.empty() ? "body" : where, "Input should be a valid dictionary or object to extract fields from");
  for (const auto& [key, value] : body.items())
    if (std::find(fields.begin(), fields.end(), key) == fields.end())
      invalid(loc(where, key), "Extra inputs are not permitted");
}

bool present(const Json& body, const char* field) { return body.contains(field) && !body[field].is_null(); }

int64_t strict_int(const Json& v, const std::string& where) {
  if (!v.is_number_integer()) invalid(where, "Input should be a valid integer");
  return v.get<int64_t>();
}

std::optional<int64_t> optional_int(const Json& body, const char* field, const std::string& where) {
  if (!present(body, field)) return std::nullopt;
  return strict_int(body[field], loc(where, field));
}

std::vector<int64_t> int_list(const Json& v, const std::string& where) {
  if (!v.is_array()) invalid(where, "Input should be a valid list");
  std::vector<int64_t> out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) out.push_back(strict_int(v[i], where + "." + std::to_string(i)));
  return out;
}

std::string value_text(const Json& v, const std::string& where) {  // Union[StrictStr, StrictInt] as Python's str(v)
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  invalid(where, "Input should be a valid string");
}

std::optional<double> deadline(const Json& body) {
  if (!present(body, "deadline_ms")) return std::nullopt;
  if (!body["deadline_ms"].is_number()) invalid("deadline_ms", "Input should be a valid number");
  const double ms = body["deadline_ms"].get<double>();
  if (!(ms > 0)) invalid("deadline_ms", "Input should be greater than 0");
  return ms;
}

std::string check_int_message(const std::string& name, int64_t lo, int64_t hi, int64_t value) {
  return name + " must be an int in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(value);
}

int64_t check_int(const std::string& name, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) bad(check_int_message(name, lo, hi, value));
  return value;
}

// A user's filter (UserBody.filter: Optional[StrictStr]).
std::optional<std::string> user_filter(const Json& u, const std::string& where) {
  if (!present(u, "filter")) return std::nullopt;
  if (!u["filter"].is_string()) invalid(loc(where, "filter"), "Input should be a valid string");
  return u["filter"].get<std::string>();
}

// UserBody -> UserRequest (types only; RecEncoder checks the values)
UserRequest user_request(const Json& u, const std::string& where) {
  UserRequest r;
  user_filter(u, where);  // its type (recommend reads it, rank ignores it)
  if (present(u, "user_id")) r.user_id = strict_int(u["user_id"], loc(where, "user_id"));
  if (present(u, "history")) r.history = int_list(u["history"], loc(where, "history"));
  if (present(u, "exclude")) r.exclude = int_list(u["exclude"], loc(where, "exclude"));
  if (present(u, "features")) {
    if (!u["features"].is_object()) invalid(loc(where, "features"), "Input should be a valid dictionary");
    for (const auto& [name, raw] : u["features"].items()) {
      const std::string at = loc(where, "features." + name);
      std::vector<std::string> values;
      if (raw.is_array()) {
        for (size_t i = 0; i < raw.size(); ++i) values.push_back(value_text(raw[i], at + "." + std::to_string(i)));
      } else {
        values.push_back(value_text(raw, at));
      }
      r.features.emplace_back(name, std::move(values));
    }
  }
  if (present(u, "numeric")) {
    if (!u["numeric"].is_object()) invalid(loc(where, "numeric"), "Input should be a valid dictionary");
    for (const auto& [name, x] : u["numeric"].items()) {
      if (!x.is_number()) invalid(loc(where, "numeric." + name), "Input should be a valid number");
      r.numeric.emplace_back(name, x.get<double>());
    }
  }
  return r;
}

// The filter index of a manifest's config["filter"] (filter_program.py FilterPlan.from_config).
std::unique_ptr<FilterCompiler> make_filter_compiler(const Json& cfg) {
  const Json& bloom = cfg.at("bloom");
  std::vector<std::string> names, values;
  std::vector<int64_t> value_counts, exact, postings, counts, planes;
  for (const auto& [name, meta] : cfg.at("features").items()) {
    const Json& vals = meta.at("values");
    const size_t n = vals.size();
    names.push_back(name);
    value_counts.push_back(int64_t(n));
    for (const Json& v : vals) values.push_back(v.get<std::string>());
    const Json e = meta.value("exact", Json());
    if (e.is_object()) exact.insert(exact.end(), {e.at("row").get<int64_t>(), e.at("slots").get<int64_t>(), e.at("bits").get<int64_t>()});
    else exact.insert(exact.end(), {-1, 0, 0});
    auto column = [&](const char* key, int64_t fill, std::vector<int64_t>& out) {
      const std::vector<int64_t> got = meta.contains(key) ? meta[key].get<std::vector<int64_t>>() : std::vector<int64_t>(n, fill);
      out.insert(out.end(), got.begin(), got.end());
    };
    column("postings", -1, postings);
    column("counts", 0, counts);
    column("planes", -1, planes);
  }
  return std::make_unique<FilterCompiler>(bloom.at("bits").get<int64_t>(), bloom.at("hashes").get<int64_t>(),
                                          int64_t(bloom.at("seed").get<uint64_t>()), cfg.at("rows").get<int64_t>(),
                                          cfg.value("items", int64_t(0)), names, value_counts, values, exact, postings,
                                          counts, planes);
}

std::vector<std::string> user_fields(std::vector<std::string> extra) {
  std::vector<std::string> out(std::begin(kUserFields), std::end(kUserFields));
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

Json clean_row(const at::Tensor& scores_row) {  // float32 [k] -> numbers, null for -inf / nan
  Json row = Json::array();
  const float* s = scores_row.data_ptr<float>();
  for (int64_t j = 0; j < scores_row.numel(); ++j)
    row.push_back(std::isfinite(s[j]) ? Json(double(s[j])) : Json(nullptr));
  return row;
}

Json id_rows(const at::Tensor& ids, int64_t start, int64_t n, int64_t k) {
  Json out = Json::array();
  for (int64_t b = start; b < start + n; ++b) {
    const at::Tensor row = ids[b].slice(0, 0, k).contiguous();
    out.push_back(std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel()));
  }
  return out;
}

Json score_rows(const at::Tensor& scores, int64_t start, int64_t n, int64_t k) {
  Json out = Json::array();
  for (int64_t b = start; b < start + n; ++b) out.push_back(clean_row(scores[b].slice(0, 0, k).contiguous()));
  return out;
}

// The program's (item ids [B, k], scores [B, k], ...) cut into each job's rows and k.
std::vector<Json> top_k_answers(const std::vector<const Job*>& group, const c10::intrusive_ptr<c10::ivalue::Tuple>& out) {
  const at::Tensor ids = out->elements()[0].toTensor().contiguous(), scores = out->elements()[1].toTensor().contiguous();
  std::vector<Json> answers;
  int64_t start = 0;
  for (const Job* j : group) {
    const int64_t n = j->rows();
    answers.push_back({{"item_ids", id_rows(ids, start, n, j->k)}, {"scores", score_rows(scores, start, n, j->k)}});
    start += n;
  }
  return answers;
}

}  // namespace

std::optional<Route> route_named(const std::string& name) {
  const std::string n = name.rfind("/v1/", 0) == 0 ? name.substr(4) : name;
  if (n == "search") return Route::Search;
  if (n == "recommend") return Route::Recommend;
  if (n == "rank") return Route::Rank;
  return std::nullopt;
}

Service::Service(const std::string& root) : root_(root) {
  manifest_ = read_manifest(root);
  check_build(manifest_, root);
  kind_ = manifest_.value("kind", std::string());
  config_ = manifest_.value("config", Json::object());
  version_ = snapshot_version(manifest_, root);
  item_count_ = manifest_.value("item_count", int64_t(0));
  const Json spec = config_.value("spec", Json::object());
  const std::string tower = spec.value("tower", std::string());
  if (kind_ == "rec") answers_ = tower == "query" ? "search" : "recommend";  // served.py answers()
  if (answers_.empty())
    throw SnapshotError("snapshot " + root + " of kind '" + kind_ + "': silverrec-predictor serves one snapshot "
                        "directory of kind 'rec'; serve this one with `silverrec serve`");
  load_program_libraries(manifest_);
  module_ = load_scripted(root, manifest_);
  const std::vector<std::string> sources = spec.value("sources", std::vector<std::string>{"ann"});
  ann_ = std::find(sources.begin(), sources.end(), "ann") != sources.end();
  generative_ = std::find(sources.begin(), sources.end(), "generative") != sources.end();
  ranks_ = tower == "two_tower" || tower == "sequence" || tower == "byo";  // spec.py TRAINED_TOWERS
  transitions_ = spec.value("transitions", int64_t(0)) > 0;
  nlist_ = spec.value("nlist", int64_t(0));
  tasks_ = spec.value("tasks", std::vector<std::string>{"query"});
  sources_ = sources;
  if (config_.value("filter", Json()).is_object()) filters_ = make_filter_compiler(config_["filter"]);
  if (answers_ != "recommend") return;
  const std::map<std::string, at::Tensor> items = read_npz(root + "/items.npz");
  row_to_item_ = items.at("row_to_item").to(at::kLong);
  std::map<std::string, at::Tensor> users;
  if (manifest_.value("files", Json::object()).contains("users.npz"))
    users = read_npz(root + "/users.npz");
  const Json features = config_.at("user_features");
  const std::vector<std::string> order = config_.at("item_feature_order").get<std::vector<std::string>>();
  std::vector<at::Tensor> offsets, codes;
  for (const Json& pair : features.at("item_vocabs")) {  // the tower's item features, in its order
    const std::string name = pair.at(0).get<std::string>();
    const size_t i = size_t(std::find(order.begin(), order.end(), name) - order.begin());
    offsets.push_back(items.at("offsets_" + std::to_string(i)));
    codes.push_back(items.at("codes_" + std::to_string(i)));
  }
  std::vector<std::string> vocab_names, vocab_values, numeric_names;
  std::vector<int64_t> vocab_sizes;
  std::vector<double> mean, std;
  for (const Json& pair : features.value("user_vocabs", Json::array())) {
    vocab_names.push_back(pair.at(0).get<std::string>());
    for (const Json& v : pair.at(1)) vocab_values.push_back(v.is_string() ? v.get<std::string>() : v.dump());
    vocab_sizes.push_back(int64_t(pair.at(1).size()));
  }
  for (const Json& pair : features.value("user_numeric", Json::array())) {
    numeric_names.push_back(pair.at(0).get<std::string>());
    mean.push_back(pair.at(1).at(0).get<double>());
    std.push_back(pair.at(1).at(1).get<double>());
  }
  const at::Tensor none = at::zeros({0}, at::kLong);
  const bool has_users = !users.empty();
  encoder_ = std::make_unique<RecEncoder>(
      row_to_item_, offsets, codes, has_users, has_users ? users.at("user_ids").to(at::kLong) : none,
      has_users ? users.at("offsets").to(at::kLong) : none, has_users ? users.at("item_ids").to(at::kLong) : none,
      vocab_names, vocab_values, vocab_sizes, numeric_names, mean, std, features.at("history_len").get<int64_t>(),
      features.at("recent_len").get<int64_t>());
  exclude_limit_ = config_.at("exclude_limit").get<int64_t>();
}

Json Service::model_info() const {
  return {{"version", version_}, {"kind", kind_}, {"path", root_}, {"backend", "torchscript"}, {"manifest", manifest_}};
}

Job Service::prepare(Route route, const Json& body) const {
  if (route == Route::Search) return prepare_search(body);
  if (route == Route::Recommend) return prepare_recommend(body);
  return prepare_rank(body);
}

// ------------------------------------------------------------------------------------------------ search
Job Service::prepare_search(const Json& body) const {
  allow_fields(body, {"queries", "k", "filter", "nprobe", "max_probe", "mode", "deadline_ms"}, "");
  if (!body.contains("queries")) invalid("queries", "Field required");
  const Json& q = body["queries"];
  if (!q.is_array()) invalid("queries", "Input should be a valid list");
  for (size_t i = 0; i < q.size(); ++i) {
    if (!q[i].is_array()) invalid("queries." + std::to_string(i), "Input should be a valid list");
    for (size_t j = 0; j < q[i].size(); ++j)
      if (!q[i][j].is_number())
        invalid("queries." + std::to_string(i) + "." + std::to_string(j), "Input should be a valid number");
  }
  const int64_t k_given = body.contains("k") ? strict_int(body["k"], "k") : 10;
  const std::optional<int64_t> nprobe_given = optional_int(body, "nprobe", "");
  const std::optional<int64_t> max_probe_given = optional_int(body, "max_probe", "");
  if (present(body, "mode")) {
    const Json& m = body["mode"];
    if (!m.is_string() && !m.is_array()) invalid("mode", "Input should be a valid string");
    for (size_t i = 0; m.is_array() && i < m.size(); ++i)
      if (!m[i].is_string()) invalid("mode." + std::to_string(i), "Input should be a valid string");
  }
  if (present(body, "filter")) {  // Union[StrictStr, list[Optional[StrictStr]], None]
    const Json& f = body["filter"];
    if (!f.is_string() && !f.is_array()) invalid("filter", "Input should be a valid string");
    for (size_t i = 0; f.is_array() && i < f.size(); ++i)
      if (!f[i].is_null() && !f[i].is_string()) invalid("filter." + std::to_string(i), "Input should be a valid string");
  }
  Job job{Route::Search};
  job.deadline_ms = deadline(body);
  if (answers_ != "search")
    bad("this snapshot is not a pure-ANN index: it does not answer /v1/search (use /v1/recommend)");
  if (q.empty()) bad("queries must hold at least one row");
  if (int64_t(q.size()) > kMaxQueryRows)
    bad(std::to_string(q.size()) + " query rows exceed the limit of " + std::to_string(kMaxQueryRows) + " per request");
  const int64_t dim = config_.at("dim").get<int64_t>(), B = int64_t(q.size());
  for (int64_t i = 0; i < B; ++i)
    if (int64_t(q[size_t(i)].size()) != dim)
      bad("query row " + std::to_string(i) + " has " + std::to_string(q[size_t(i)].size()) + " values, the index holds " +
          std::to_string(dim) + "-d items");
  job.queries = at::empty({B, dim}, at::kFloat);
  float* x = job.queries.data_ptr<float>();
  for (int64_t i = 0; i < B; ++i)
    for (int64_t j = 0; j < dim; ++j) x[i * dim + j] = float(q[size_t(i)][size_t(j)].get<double>());
  if (k_given <= 0) bad("k must be positive, got " + std::to_string(k_given));
  if (k_given > item_count_)
    bad("k=" + std::to_string(k_given) + " exceeds the " + std::to_string(item_count_) + " items in the index");
  job.k = k_given;
  if (nprobe_given) job.nprobe = check_int("nprobe", *nprobe_given, 1, nlist_);  // else 0: the calibrated depth
  // filters (normalize_filters): one string for every row, or one string or null per row; none at all: unfiltered
  if (present(body, "filter")) {
    const Json& f = body["filter"];
    if (f.is_string()) {
      job.filters.assign(size_t(B), f.get<std::string>());
    } else {
      for (size_t i = 0; i < f.size(); ++i) {
        job.filters.push_back(f[i].is_null() ? std::nullopt : std::optional<std::string>(f[i].get<std::string>()));
      }
      if (int64_t(f.size()) != B)
        bad("got " + std::to_string(f.size()) + " filters for " + std::to_string(B) +
            " query rows: give one per row, or one string for all");
    }
    job.filtered = std::any_of(job.filters.begin(), job.filters.end(), [](const auto& x) { return x.has_value(); });
  }
  if (!job.filtered) {  // unfiltered: max_probe and mode unused, as in snap.search
    job.filters.clear();
    job.group = "search/" + std::to_string(job.nprobe);
    return job;
  }
  // the search modes, one per row (filtered_search.py _modes)
  auto mode_of = [](const std::string& name) {
    if (!kModes.count(name)) bad("unknown search mode " + py_repr(name) + ": use one of ['auto', 'probed', 'unprobed']");
    return kModes.at(name);
  };
  if (!present(body, "mode") || body["mode"].is_string()) {
    job.modes.assign(size_t(B), mode_of(present(body, "mode") ? body["mode"].get<std::string>() : "auto"));
  } else {
    if (int64_t(body["mode"].size()) != B)
      bad("got " + std::to_string(body["mode"].size()) + " modes for " + std::to_string(B) + " query rows");
    for (const Json& m : body["mode"]) job.modes.push_back(mode_of(m.get<std::string>()));
  }
  if (max_probe_given) job.max_probe = check_int("max_probe", *max_probe_given, job.nprobe ? job.nprobe : 1, nlist_);
  const FilterCompiler& compiler = filter_compiler();
  for (const auto& f : job.filters) {  // syntax errors (with position) and unknown features, row by row
    if (!f) continue;
    try {
      compiler.compile(*f);
    } catch (const RequestError& e) {
      bad(e.message);
    }
  }
  // the widening step reads k (match_factor * k), so only equal k share a forward
  job.group = "fsearch/" + std::to_string(job.nprobe) + "/" + std::to_string(job.max_probe) + "/" + std::to_string(job.k);
  return job;
}

const FilterCompiler& Service::filter_compiler() const {
  if (!filters_) bad("snapshot " + root_ + " has no filter index (its pool had no categorical features)");
  if (!config_["filter"].contains("postings")) bad("snapshot " + root_ + " has no posting-list section: re-publish it");
  return *filters_;
}

int64_t Service::probe_depth(int64_t k, double density) const {
  // the snapshot's default depth, deepened for a large k or a selective filter: base x max(1, k / (k_cal d))^exponent
  const Json search = config_.value("search", Json::object());
  const double exponent = search.value("probe_exponent", 0.0), k_cal = double(search.value("probe_k", int64_t(100)));
  const double d = std::min(1.0, std::max(1e-12, density));
  const double scale = std::pow(std::max(1.0, double(k) / (k_cal * d)), exponent);
  const double base = double(config_.at("default_nprobe").get<int64_t>());
  return std::min(nlist_, int64_t(std::ceil(base * scale - 1e-9)));
}

std::vector<c10::IValue> Service::filter_inputs(const std::vector<std::optional<std::string>>& filters,
                                                const at::Tensor& modes) const {
  const RequestPrograms p = filters_->request(filters);
  return {p.ops, p.rows, p.vops, p.vrows, p.lists, modes};
}

std::vector<c10::IValue> Service::no_filters(int64_t B, int64_t mode) const {
  // compile_request([None] * B): TRUE programs (Bloom and verify), no posting lists; then the modes
  const at::Tensor ops = at::full({B, 1}, kOpTrue, at::kLong), rows = at::zeros({B, 1, 1}, at::kLong);
  const at::Tensor lists = at::full({B, 1}, kNoLists, at::kLong), modes = at::full({B}, mode, at::kLong);
  return {ops, rows, ops, rows, lists, modes};
}

std::vector<Json> Service::run_search(const std::vector<const Job*>& group) {
  std::vector<at::Tensor> parts;
  std::vector<std::optional<std::string>> filters;
  std::vector<int64_t> modes;
  int64_t k = 0;
  for (const Job* j : group) {
    parts.push_back(j->queries);
    k = std::max(k, j->k);
    filters.insert(filters.end(), j->filters.begin(), j->filters.end());
    modes.insert(modes.end(), j->modes.begin(), j->modes.end());
  }
  const at::Tensor queries = parts.size() == 1 ? parts[0] : at::cat(parts);
  const int64_t B = queries.size(0), nprobe = group[0]->nprobe;
  std::vector<c10::IValue> args = {at::zeros({3}, at::kLong), at::zeros({4}, at::kInt), queries,
                                   at::full({B, 1}, -1, at::kLong)};
  int64_t depth = nprobe ? nprobe : probe_depth(k, 1.0), max_probe = depth;
  if (group[0]->filtered) {  // filtered_search.py search_index: each row's route and the batch's probe depths
    const Json& search = config_.at("search");
    const int64_t N = filters_->num_items();
    bool any_auto = false;
    for (int64_t m : modes) any_auto |= m == kModeAuto;
    const bool estimated = N > 0 && any_auto;
    const std::vector<double> est = estimated ? filters_->estimates(filters) : std::vector<double>();
    std::vector<int64_t> depths(size_t(B), nprobe);
    for (int64_t b = 0; b < B && !nprobe; ++b)  // the calibrated depth for the filter's estimated share (auto rows)
      depths[size_t(b)] = probe_depth(k, estimated && modes[size_t(b)] == kModeAuto ? est[size_t(b)] / double(N) : 1.0);
    if (estimated) {  // selective filters: the whole pool, no probing (whole_pool_by_estimate)
      const double factor = double(search.at("match_factor").get<int64_t>()), ratio = search.at("exact_cost_ratio").get<double>();
      for (int64_t b = 0; b < B; ++b) {
        const double m = std::max(est[size_t(b)], 1e-9);
        const double target = double(k) * factor / std::sqrt(m / double(N));
        const double probed = std::max(double(depths[size_t(b)]) * double(std::max<int64_t>(1, N / nlist_)), target * double(N) / m);
        if (modes[size_t(b)] == kModeAuto && m * ratio <= probed) modes[size_t(b)] = kModeUnprobed;
      }
    }
    int64_t deepest = -1, shallowest = INT64_MAX;  // the batch probes as deep as its deepest probing row
    for (int64_t b = 0; b < B; ++b) {
      if (modes[size_t(b)] != kModeUnprobed) deepest = std::max(deepest, depths[size_t(b)]);
      shallowest = std::min(shallowest, depths[size_t(b)]);
    }
    depth = deepest >= 0 ? deepest : shallowest;
    const int64_t given = group[0]->max_probe;
    if (!nprobe && given) depth = std::min(depth, std::max<int64_t>(1, given));  // a given widest probe bounds it
    if (given) {
      max_probe = given;
    } else {  // default_max_probe: max_probe_factor x the depth, or the manifest's default_max_probe
      const Json factor = search.value("max_probe_factor", Json());
      const int64_t wide = factor.is_number() ? int64_t(std::ceil(factor.get<double>() * double(depth)))
                                              : search.at("default_max_probe").get<int64_t>();
      max_probe = std::max(depth, std::min(nlist_, wide));
    }
    at::Tensor modes_t = at::empty({B}, at::kLong);
    std::copy(modes.begin(), modes.end(), modes_t.data_ptr<int64_t>());
    for (c10::IValue& v : filter_inputs(filters, modes_t)) args.push_back(std::move(v));
  } else {
    for (c10::IValue& v : no_filters(B, kModeProbed)) args.push_back(std::move(v));
  }
  args.insert(args.end(), {at::full({B, 1}, -1, at::kLong), at::ones({B, 2}, at::kBool)});  // no history, the ANN on
  for (int64_t v : {k, k, depth, max_probe}) args.emplace_back(v);
  return top_k_answers(group, module_.forward(args).toTuple());
}

// ------------------------------------------------------------------------------------------------ recommend
void Service::check_template(const UserRequest& r, int64_t b) const {
  const Json t = config_.value("filter_template", Json());
  if (!t.is_object()) return;
  for (const Json& bind : t.at("bindings")) {
    const std::string g = bind.at("user_feature").get<std::string>();
    int64_t n = 0;
    for (const auto& [name, values] : r.features)
      if (name == g) n = int64_t(values.size());
    const std::string where = "request " + std::to_string(b);
    if (n == 0)
      bad(where + ": the snapshot's filter template binds $user." + g + " (item feature " +
          py_repr(bind.at("item_feature").get<std::string>()) + "), but the request has no user feature " + py_repr(g));
    const bool many = bind.at("many").get<bool>();
    const int64_t cap = many ? t.at("max_values").get<int64_t>() : 1;
    if (n > cap)
      bad(where + ": user feature " + py_repr(g) + " has " + std::to_string(n) + " values; the filter template binds " +
          (many ? "at most " + std::to_string(cap) : std::string("one (with =)")));
  }
}

Job Service::prepare_recommend(const Json& body) const {
  allow_fields(body, user_fields({"requests", "k", "k0", "nprobe", "max_probe", "mode", "exclude_history", "deadline_ms"}), "");
  std::vector<Json> users;
  if (present(body, "requests")) {
    if (!body["requests"].is_array()) invalid("requests", "Input should be a valid list");
    for (size_t i = 0; i < body["requests"].size(); ++i) {
      allow_fields(body["requests"][i], user_fields({}), "requests." + std::to_string(i));
      users.push_back(body["requests"][i]);
    }
  }
  const int64_t k_given = body.contains("k") ? strict_int(body["k"], "k") : 10;
  const std::optional<int64_t> k0_given = optional_int(body, "k0", ""), nprobe_given = optional_int(body, "nprobe", ""),
                               max_probe_given = optional_int(body, "max_probe", "");
  std::string mode = "auto";
  if (body.contains("mode")) {
    if (!body["mode"].is_string()) invalid("mode", "Input should be a valid string");
    mode = body["mode"].get<std::string>();
  }
  if (present(body, "exclude_history") && !body["exclude_history"].is_boolean())
    invalid("exclude_history", "Input should be a valid boolean");
  std::vector<UserRequest> parsed;
  if (present(body, "requests")) {
    for (size_t i = 0; i < users.size(); ++i) parsed.push_back(user_request(users[i], "requests." + std::to_string(i)));
  } else {
    parsed.push_back(user_request(body, ""));
  }
  Job job{Route::Recommend};
  job.deadline_ms = deadline(body);
  job.users = parsed;
  if (present(body, "requests")) {
    std::vector<std::string> given;
    for (const char* f : kUserFields)
      if (body.contains(f)) given.push_back(f);
    if (!given.empty()) {
      std::string list = "[";
      for (size_t i = 0; i < given.size(); ++i) list += (i ? ", " : "") + py_repr(given[i]);
      bad("give either 'requests' or the top-level user fields, not both (got " + list + "])");
    }
    if (users.empty()) bad("requests must hold at least one request");
    if (int64_t(users.size()) > kMaxQueryRows)
      bad(std::to_string(users.size()) + " requests exceed the limit of " + std::to_string(kMaxQueryRows) + " per call");
  }
  if (answers_ != "recommend") bad("this snapshot is a pure-ANN index: it answers /v1/search, not /v1/recommend");
  const int64_t n = encoder_->num_items();
  job.k = check_int("k", k_given, 1, n);
  job.k0 = std::max(job.k, k0_given ? check_int("k0", *k0_given, 1, n) : config_.at("default_k0").get<int64_t>());
  if (ann_) {  // recommend.py probes(): without an index, (1, 1), unread
    job.nprobe = check_int("nprobe", nprobe_given.value_or(config_.at("default_nprobe").get<int64_t>()), 1, nlist_);
    job.max_probe = check_int("max_probe", max_probe_given.value_or(std::max(
                                               job.nprobe, config_.at("search").at("default_max_probe").get<int64_t>())),
                              job.nprobe, nlist_);
  } else {
    job.nprobe = job.max_probe = 1;
  }
  if (!kModes.count(mode)) bad("unknown search mode " + py_repr(mode) + ": use one of ['auto', 'probed', 'unprobed']");
  job.mode = kModes.at(mode);
  job.exclude_history = present(body, "exclude_history") ? body["exclude_history"].get<bool>() : true;
  for (size_t b = 0; b < parsed.size(); ++b)
    job.filters.push_back(user_filter(present(body, "requests") ? users[b] : body, ""));
  // served.py request_error: each user encoded alone (ids, user, features), then its filter compiled; the first
  // error names its request ("request 0" -> "request" or "request b"); then the filter template's features
  for (size_t b = 0; b < parsed.size(); ++b) {
    const std::string where = parsed.size() > 1 ? "request " + std::to_string(b) : "request";
    try {
      encoder_->encode({parsed[b]}, job.exclude_history, exclude_limit_);
      if (job.filters[b]) filters_->compile(*job.filters[b]);
    } catch (const RequestError& e) {
      std::string message = e.message;
      const size_t at = message.find("request 0");
      if (at != std::string::npos) message.replace(at, 9, where);
      bad(message);
    }
  }
  for (size_t b = 0; b < parsed.size(); ++b) check_template(parsed[b], int64_t(b));
  // the handler's own bound: at most the candidates the model ranks (the ANN's, the next-item transitions'
  // successors, the beams)
  const int64_t beams = generative_ ? config_.at("generative").at("beam_width").get<int64_t>() : 0;
  const int64_t candidates = config_.at("spec").value("candidates", int64_t(0));
  const int64_t successors = config_.at("spec").value("transitions", int64_t(0));
  check_int("k", job.k, 1, std::min(n, (ann_ ? (candidates ? candidates : n) + successors : 0) + beams));
  job.users = std::move(parsed);
  job.group = "rec/" + std::to_string(job.k0) + "/" + std::to_string(job.nprobe) + "/" + std::to_string(job.max_probe) +
              "/" + mode + "/" + (job.exclude_history ? "1" : "0");
  return job;
}

std::vector<Json> Service::run_recommend(const std::vector<const Job*>& group) {
  std::vector<UserRequest> users;
  int64_t k = 0;
  for (const Job* j : group) {
    users.insert(users.end(), j->users.begin(), j->users.end());
    k = std::max(k, j->k);
  }
  const Job& first = *group[0];
  const bool templated = config_.value("filter_template", Json()).is_object();
  const bool exclude_history =
      first.exclude_history || (templated && config_["filter_template"].value("excludes_history", false));
  const EncodedUsers e = encoder_->encode(users, exclude_history, exclude_limit_);
  const int64_t B = int64_t(users.size());
  std::vector<c10::IValue> args = {e.values, e.lengths, e.dense, e.exclude};
  std::vector<std::optional<std::string>> filters;
  for (const Job* j : group)
    for (size_t b = 0; b < j->users.size(); ++b) filters.push_back(b < j->filters.size() ? j->filters[b] : std::nullopt);
  if (std::any_of(filters.begin(), filters.end(), [](const auto& f) { return f.has_value(); })) {
    // recommend.py: a row without a filter probes (unless a template filters it), the others take the mode
    at::Tensor modes = at::empty({B}, at::kLong);
    for (int64_t b = 0; b < B; ++b) modes.data_ptr<int64_t>()[b] = filters[size_t(b)] || templated ? first.mode : kModeProbed;
    for (c10::IValue& v : filter_inputs(filters, modes)) args.push_back(std::move(v));
  } else {
    for (c10::IValue& v : no_filters(B, templated ? first.mode : kModeProbed)) args.push_back(std::move(v));
  }
  if (generative_) {
    // the decode's input (generative/source.py request_tensors): each history's newest max_items rows, left-padded
    // with -1 to max(2, longest), and the sources every request asks (all the snapshot's)
    const Json max_items = config_.at("generative").value("max_items", Json());
    const int64_t cap = max_items.is_number_integer() ? max_items.get<int64_t>() : INT64_MAX;
    const int64_t* off = e.history_offsets.data_ptr<int64_t>();
    int64_t H = 2;
    for (int64_t b = 0; b < B; ++b) H = std::max(H, std::min(cap, off[b + 1] - off[b]));
    at::Tensor history = at::full({B, H}, -1, at::kLong), flags = at::zeros({B, 2}, at::kBool);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = std::min(cap, off[b + 1] - off[b]);
      std::copy_n(e.history_rows.data_ptr<int64_t>() + off[b + 1] - len, len, history.data_ptr<int64_t>() + b * H + H - len);
      for (int s = 0; s < 2; ++s)
        if (std::find(sources_.begin(), sources_.end(), kSources[s]) != sources_.end()) flags.data_ptr<bool>()[b * 2 + s] = true;
    }
    args.insert(args.end(), {history, flags});
  } else if (transitions_) {  // the next-item transitions (retrieval/transitions.py) read the newest history row
    const int64_t* off = e.history_offsets.data_ptr<int64_t>();
    at::Tensor last = at::full({B, 1}, -1, at::kLong);
    for (int64_t b = 0; b < B; ++b)
      if (off[b + 1] > off[b]) last.data_ptr<int64_t>()[b] = e.history_rows.data_ptr<int64_t>()[off[b + 1] - 1];
    args.insert(args.end(), {last, at::ones({B, 2}, at::kBool)});
  } else {  // the ANN alone reads neither: no history, the ANN on
    args.insert(args.end(), {at::full({B, 1}, -1, at::kLong), at::ones({B, 2}, at::kBool)});
  }
  for (int64_t v : {k, first.k0, first.nprobe, first.max_probe}) args.emplace_back(v);
  const auto out = module_.forward(args).toTuple();
  const at::Tensor ids = out->elements()[0].toTensor().contiguous(), scores = out->elements()[1].toTensor().contiguous();
  const at::Tensor tasks = out->elements()[2].toTensor().contiguous(), found_by = out->elements()[4].toTensor().contiguous();
  std::vector<Json> answers;
  int64_t start = 0;
  for (const Job* j : group) {
    const int64_t n = j->rows();
    Json task_scores = Json::object();
    for (size_t t = 0; t < tasks_.size(); ++t)
      task_scores[tasks_[t]] = score_rows(tasks.select(2, int64_t(t)), start, n, j->k);
    Json answer = {{"item_ids", id_rows(ids, start, n, j->k)}, {"scores", score_rows(scores, start, n, j->k)},
                   {"task_scores", task_scores}};
    if (found_by.size(1)) {  // which sources found each item (bits 1 = ann, 2 = generative)
      Json rows = Json::array();
      for (int64_t b = start; b < start + n; ++b) {
        Json row = Json::array();
        for (int64_t i = 0; i < std::min(j->k, found_by.size(1)); ++i) {
          Json names = Json::array();
          for (int s = 0; s < 2; ++s)
            if (found_by[b][i].item<int64_t>() >> s & 1) names.push_back(kSources[s]);
          row.push_back(names);
        }
        rows.push_back(row);
      }
      answer["sources"] = rows;
    }
    answers.push_back(std::move(answer));
    start += n;
  }
  return answers;
}

// ------------------------------------------------------------------------------------------------ rank
Job Service::prepare_rank(const Json& body) const {
  allow_fields(body, user_fields({"items", "deadline_ms"}), "");
  if (!body.contains("items")) invalid("items", "Field required");
  Job job{Route::Rank};
  job.items = int_list(body["items"], "items");
  UserRequest r = user_request(body, "");
  job.deadline_ms = deadline(body);
  if (answers_ != "recommend" || !ranks_)
    bad("only a recommendation model with a user tower (silverrec publish --config) ranks items for a user");
  if (job.items.empty() || int64_t(job.items.size()) > kMaxRankItems)
    bad("rank takes 1 to " + std::to_string(kMaxRankItems) + " item ids, got " + std::to_string(job.items.size()));
  try {
    encoder_->items().rows(job.items, "items");
    encoder_->encode({r}, false, std::max<int64_t>(1, int64_t(r.exclude.size())));
  } catch (const RequestError& e) {
    bad(e.what());
  }
  const Json kind = config_.at("spec").value("overarch", Json());
  const std::string overarch = kind.is_string() ? kind.get<std::string>() : "None";
  const int64_t limit = overarch == "listwise" ? kMaxListwiseRankItems : kMaxRankItems;
  if (int64_t(job.items.size()) > limit)
    bad("rank takes 1 to " + std::to_string(limit) + " item ids with this snapshot's OverArch (" + overarch + "), got " +
        std::to_string(job.items.size()));
  job.users = {std::move(r)};
  return job;  // an empty group: a forward of its own
}

Json Service::run_rank(const Job& job) {
  const std::vector<int64_t> rows = encoder_->items().rows(job.items, "items");
  const EncodedUsers e = encoder_->encode(job.users, false, std::max<int64_t>(1, int64_t(job.users[0].exclude.size())));
  at::Tensor r = at::empty({1, int64_t(rows.size())}, at::kLong);
  std::copy(rows.begin(), rows.end(), r.data_ptr<int64_t>());
  const auto out = module_.get_method("rank")({e.values, e.lengths, e.dense, r}).toTuple();
  const at::Tensor value = out->elements()[0].toTensor().contiguous(), tasks = out->elements()[1].toTensor().contiguous();
  const int64_t C = int64_t(rows.size());
  Json task_scores = Json::object();
  for (size_t t = 0; t < tasks_.size(); ++t) task_scores[tasks_[t]] = score_rows(tasks.select(2, int64_t(t)), 0, 1, C);
  return {{"item_ids", Json::array({job.items})}, {"scores", score_rows(value, 0, 1, C)}, {"task_scores", task_scores}};
}

std::vector<Json> Service::run(const std::vector<const Job*>& group) {
  c10::InferenceMode guard;
  if (group[0]->route == Route::Search) return run_search(group);
  if (group[0]->route == Route::Recommend) return run_recommend(group);
  std::vector<Json> out;
  for (const Job* j : group) out.push_back(run_rank(*j));
  return out;
}

void Service::smoke() {
  Job job;
  if (answers_ == "search") {
    job = prepare(Route::Search, {{"queries", Json::array({std::vector<double>(size_t(config_.at("dim").get<int64_t>()), 0.1)})},
                                  {"k", 1}});
  } else {  // the first item's history, and a value for each feature a filter template binds
    job.route = Route::Recommend;
    job.k = job.k0 = 1;
    job.nprobe = job.max_probe = ann_ ? config_.at("default_nprobe").get<int64_t>() : 1;
    job.mode = kModeAuto;
    UserRequest r;
    r.history = std::vector<int64_t>{row_to_item_[0].item<int64_t>()};
    const Json t = config_.value("filter_template", Json());
    if (t.is_object())
      for (const Json& bind : t.at("bindings")) r.features.emplace_back(bind.at("user_feature").get<std::string>(),
                                                                        std::vector<std::string>{""});
    job.users = {r};
  }
  const Json out = run({&job})[0];
  if (out.at("item_ids").size() != 1 || out["item_ids"][0].size() != 1)
    throw SnapshotError("the program answered a smoke request with the wrong shape");
}

}  // namespace silverrec
