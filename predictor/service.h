// One loaded snapshot as silverrec-predictor serves it: requests in the JSON of `silverrec serve`'s /v1/search,
// /v1/recommend and /v1/rank (silverrec/serving/schemas.py) validated into jobs (silverrec/serving/served.py's
// checks and messages), groups of jobs answered by one forward call of the TorchScript program.
#pragma once

#include "filter_compiler.h"
#include "request.h"
#include "snapshot.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace silverrec {

// A request the predictor refuses: status 400 (an invalid request: served.py's QueryError messages) or 422 (a body
// of the wrong shape or types, as the pydantic models refuse it).
struct BadRequest : std::runtime_error {
  int status;
  BadRequest(int status, const std::string& message) : std::runtime_error(message), status(status) {}
};

enum class Route { Search, Recommend, Rank };
std::optional<Route> route_named(const std::string& name);  // "search" | "recommend" | "rank", with or without /v1/

// One validated request. Jobs with equal `group` share a forward call (an empty group: a call of its own).
struct Job {
  Route route;
  std::string group;
  int64_t k = 0;
  std::optional<double> deadline_ms;
  at::Tensor queries;  // search: float32 [B, D]
  std::vector<UserRequest> users;  // recommend: one or more; rank: one
  std::vector<int64_t> items;  // rank: item ids
  // search: one filter per query row (none: unfiltered) and its mode; recommend: one filter per user
  std::vector<std::optional<std::string>> filters;
  std::vector<int64_t> modes;
  bool filtered = false;  // search: the rows carry filters (filtered_search.py's routing)
  // search: nprobe 0 = the calibrated depth (probe_depth), max_probe 0 = the default; recommend: both resolved
  int64_t k0 = 0, nprobe = 0, max_probe = 0, mode = 0;
  bool exclude_history = true;
  int64_t rows() const { return route == Route::Search ? queries.size(0) : int64_t(users.size()); }
};

class Service {
 public:
  explicit Service(const std::string& root);
  const std::string& version() const { return version_; }
  const std::string& kind() const { return kind_; }
  const std::string& answers() const { return answers_; }  // "search" | "recommend" | ""
  Json model_info() const;

  Job prepare(Route route, const Json& body) const;  // BadRequest when invalid
  std::vector<Json> run(const std::vector<const Job*>& group);  // one answer per job, in order
  void smoke();  // one tiny request through the program (SnapshotError if it cannot answer)

 private:
  Job prepare_search(const Json& body) const;
  Job prepare_recommend(const Json& body) const;
  Job prepare_rank(const Json& body) const;
  std::vector<Json> run_search(const std::vector<const Job*>& group);
  std::vector<Json> run_recommend(const std::vector<const Job*>& group);
  Json run_rank(const Job& job);
  std::vector<c10::IValue> no_filters(int64_t B, int64_t mode) const;
  // compile_request(filters) and the modes: the forward's filter inputs (RequestError for a bad filter)
  std::vector<c10::IValue> filter_inputs(const std::vector<std::optional<std::string>>& filters,
                                         const at::Tensor& modes) const;
  const FilterCompiler& filter_compiler() const;  // BadRequest when the snapshot has no filter index
  int64_t probe_depth(int64_t k, double density) const;  // filtered_search.py probe_depth (no target_recall)
  void check_template(const UserRequest& r, int64_t b) const;

  std::string root_, version_, kind_, answers_;
  Json manifest_, config_;
  torch::jit::Module module_;
  std::unique_ptr<RecEncoder> encoder_;
  std::unique_ptr<FilterCompiler> filters_;  // the manifest's filter index (none: the pool had no features)
  at::Tensor row_to_item_;
  std::vector<std::string> tasks_, sources_;
  int64_t item_count_ = 0, nlist_ = 0, exclude_limit_ = 0;
  bool ann_ = true, generative_ = false, ranks_ = false;  // the model's sources; a trained user tower
  bool transitions_ = false;  // next-item transitions: the forward reads each request's newest history row
};

}  // namespace silverrec
