// silverrec-predictor: a snapshot served without Python.
//
//   silverrec-predictor SNAPSHOT --route search|recommend|rank     one JSON request a line on stdin, one answer a
//                                                                  line on stdout (an error: {"detail", "status"})
//   silverrec-predictor SNAPSHOT --route ROUTE --bench-seconds S [--bench-threads T]   in-process timing: the
//       stdin's bodies read first, then T threads each answer them in turn (validation, encoding, forward, JSON
//       answer; no batching across calls) for S seconds; prints {"calls", "seconds", "p50_ms", "p99_ms", "per_s"}
//   silverrec-predictor SNAPSHOT --http PORT [--host 127.0.0.1] [--max-batch 32] [--max-wait-ms 5]
//                       [--max-queue 1024] [--threads N] [--http-threads 64]
//       POST /v1/search /v1/recommend /v1/rank (the bodies and answers of `silverrec serve`), GET /healthz /readyz
//       /v1/model /metrics. Requests are validated on arrival (400 / 422 with the message), queued (503 when
//       max-queue wait), and batched as `silverrec serve` batches: the worker, when free, takes every request
//       queued (up to max-batch) at once, so an idle server adds no wait (max-wait-ms holds a queue open only
//       beside another busy worker: with this program's one worker, never); requests with equal options share one
//       forward call. 504 when a deadline (body deadline_ms or
//       header X-Deadline-Ms) passes in the queue.
//
// The snapshot is verified (manifest, format version, sha256 of every file, the torch and silverrec that built it)
// and smoke-tested before the first request; a snapshot it cannot run is refused with exit status 2.
#include <ATen/Parallel.h>
#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "service.h"

namespace silverrec {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string snapshot, route, host = "127.0.0.1";
  int port = -1, max_batch = 32, max_queue = 1024, threads = 0, http_threads = 64, bench_threads = 1;
  double max_wait_ms = 5.0, bench_seconds = 0;
  size_t max_body_bytes = 4 << 20;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "silverrec-predictor: " << problem << "\n"
            << "usage: silverrec-predictor SNAPSHOT --route search|recommend|rank\n"
            << "       silverrec-predictor SNAPSHOT --http PORT [--host H] [--max-batch N] [--max-wait-ms MS] "
               "[--max-queue N] [--threads N] [--http-threads N]\n";
  std::exit(64);
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    auto number = [&](double lo) {
      const std::string v = value();
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      if (v.empty() || *end || x < lo) usage(a + " must be a number >= " + std::to_string(int(lo)) + ", got " + v);
      return x;
    };
    if (a == "--route") o.route = value();
    else if (a == "--http") o.port = int(number(0));
    else if (a == "--host") o.host = value();
    else if (a == "--max-batch") o.max_batch = int(number(1));
    else if (a == "--max-wait-ms") o.max_wait_ms = number(0);
    else if (a == "--max-queue") o.max_queue = int(number(1));
    else if (a == "--threads") o.threads = int(number(1));
    else if (a == "--http-threads") o.http_threads = int(number(1));
    else if (a == "--bench-seconds") o.bench_seconds = number(0);
    else if (a == "--bench-threads") o.bench_threads = int(number(1));
    else if (a == "-h" || a == "--help") usage("serves a silverrec snapshot");
    else if (!a.empty() && a[0] == '-') usage("unknown option " + a);
    else if (o.snapshot.empty()) o.snapshot = a;
    else usage("one snapshot directory, got " + o.snapshot + " and " + a);
  }
  if (o.snapshot.empty()) usage("no snapshot directory");
  if ((o.port >= 0) == !o.route.empty()) usage("give either --route (stdin / stdout) or --http PORT");
  if (!o.route.empty() && !route_named(o.route)) usage("--route must be search, recommend or rank, got " + o.route);
  return o;
}

Json error_body(const std::string& message, const std::string& version) { return {{"detail", message}, {"version", version}}; }

std::string malformed(const Json::parse_error& e) {
  return "malformed JSON at position " + std::to_string(e.byte) + ": " + e.what();
}

// ------------------------------------------------------------------------------------------------ stdin / stdout
int serve_lines(Service& service, Route route) {
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Json out;
    try {
      const Job job = service.prepare(route, Json::parse(line));
      out = service.run({&job})[0];
      out["version"] = service.version();
    } catch (const Json::parse_error& e) {
      out = error_body(malformed(e), service.version());
      out["status"] = 400;
    } catch (const BadRequest& e) {
      out = error_body(e.what(), service.version());
      out["status"] = e.status;
    } catch (const RequestError& e) {
      out = error_body(e.what(), service.version());
      out["status"] = 400;
    }
    std::cout << out.dump() << "\n" << std::flush;
  }
  return 0;
}

// ------------------------------------------------------------------------------------------------ in-process timing
int bench_lines(Service& service, Route route, const Options& o) {
  std::vector<Json> bodies;
  for (std::string line; std::getline(std::cin, line);)
    if (line.find_first_not_of(" \t\r") != std::string::npos) bodies.push_back(Json::parse(line));
  if (bodies.empty()) usage("--bench-seconds needs request bodies on stdin");
  std::vector<std::vector<double>> times(size_t(o.bench_threads));
  const Clock::time_point start = Clock::now(), stop = start + std::chrono::microseconds(int64_t(o.bench_seconds * 1e6));
  std::vector<std::thread> callers;
  for (int t = 0; t < o.bench_threads; ++t)
    callers.emplace_back([&, t] {
      for (size_t i = size_t(t); Clock::now() < stop; ++i) {
        const Clock::time_point t0 = Clock::now();
        const Job job = service.prepare(route, bodies[i % bodies.size()]);
        Json out = service.run({&job})[0];
        out["version"] = service.version();
        const std::string text = out.dump();
        times[size_t(t)].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
    });
  for (std::thread& c : callers) c.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<double> all;
  for (const auto& ts : times) all.insert(all.end(), ts.begin(), ts.end());
  std::sort(all.begin(), all.end());
  auto q = [&](double p) { return all[std::min(all.size() - 1, size_t(p * double(all.size() - 1) + 0.5))]; };
  std::cout << Json{{"calls", all.size()}, {"seconds", seconds}, {"p50_ms", q(0.5)}, {"p99_ms", q(0.99)},
                    {"per_s", double(all.size()) / seconds}}.dump() << "\n";
  return 0;
}

// ------------------------------------------------------------------------------------------------ metrics
class Metrics {
 public:
  void request(const std::string& route, int status, double seconds) {
    std::lock_guard<std::mutex> lock(m_);
    ++requests_[{route, status}];
    Histogram& h = latency_[route];
    h.observe(seconds, kLatencyBuckets);
  }
  void batch(size_t n) {
    std::lock_guard<std::mutex> lock(m_);
    batches_.observe(double(n), kBatchBuckets);
  }
  void rejection(const std::string& reason) {
    std::lock_guard<std::mutex> lock(m_);
    ++rejections_[reason];
  }
  std::string text(size_t queue, int64_t in_flight, const std::string& version, const std::string& kind) {
    std::lock_guard<std::mutex> lock(m_);
    std::ostringstream o;
    o << "# HELP silverrec_requests_total HTTP requests by route and status\n# TYPE silverrec_requests_total counter\n";
    for (const auto& [key, n] : requests_)
      o << "silverrec_requests_total{route=\"" << key.first << "\",status=\"" << key.second << "\"} " << n << "\n";
    o << "# HELP silverrec_request_latency_seconds request latency by route\n"
         "# TYPE silverrec_request_latency_seconds histogram\n";
    for (const auto& [route, h] : latency_) h.write(o, "silverrec_request_latency_seconds", "route=\"" + route + "\",", kLatencyBuckets);
    o << "# HELP silverrec_batch_requests requests per batch\n# TYPE silverrec_batch_requests histogram\n";
    batches_.write(o, "silverrec_batch_requests", "", kBatchBuckets);
    o << "# HELP silverrec_queue_depth requests waiting for a batch\n# TYPE silverrec_queue_depth gauge\n"
      << "silverrec_queue_depth " << queue << "\n";
    o << "# HELP silverrec_in_flight requests admitted and not yet answered\n# TYPE silverrec_in_flight gauge\n"
      << "silverrec_in_flight " << in_flight << "\n";
    o << "# HELP silverrec_rejections_total requests refused or dropped\n# TYPE silverrec_rejections_total counter\n";
    for (const auto& [reason, n] : rejections_) o << "silverrec_rejections_total{reason=\"" << reason << "\"} " << n << "\n";
    o << "# HELP silverrec_snapshot_info the served snapshot (value 1)\n# TYPE silverrec_snapshot_info gauge\n"
      << "silverrec_snapshot_info{version=\"" << version << "\",kind=\"" << kind << "\"} 1\n";
    return o.str();
  }

 private:
  // the buckets of silverrec/serving/metrics.py
  static constexpr double kLatencyBuckets[] = {.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5};
  static constexpr double kBatchBuckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  struct Histogram {
    std::vector<uint64_t> counts = std::vector<uint64_t>(16, 0);
    double sum = 0;
    uint64_t count = 0;
    template <size_t N>
    void observe(double x, const double (&bounds)[N]) {
      for (size_t i = 0; i < N; ++i)
        if (x <= bounds[i]) ++counts[i];
      sum += x;
      ++count;
    }
    template <size_t N>
    void write(std::ostringstream& o, const std::string& name, const std::string& labels, const double (&bounds)[N]) const {
      for (size_t i = 0; i < N; ++i) o << name << "_bucket{" << labels << "le=\"" << bounds[i] << "\"} " << counts[i] << "\n";
      o << name << "_bucket{" << labels << "le=\"+Inf\"} " << count << "\n";
      const std::string l = labels.empty() ? "" : "{" + labels.substr(0, labels.size() - 1) + "}";
      o << name << "_sum" << l << " " << sum << "\n" << name << "_count" << l << " " << count << "\n";
    }
  };
  std::mutex m_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  std::map<std::string, Histogram> latency_;
  Histogram batches_;
  std::map<std::string, uint64_t> rejections_;
};

// ------------------------------------------------------------------------------------------------ batcher
struct Outcome {
  int status = 200;
  Json body;
};

// A bounded queue of validated jobs and one worker thread that runs them in batches (silverrec/serving/batcher.py's
// policy with one worker: a free worker takes what is queued at once, up to max_batch jobs; jobs queue only while
// it computes; those past their deadline are dropped, the rest grouped by Job::group, one forward per group; a bad request in
// a group is isolated by running the group's jobs one by one).
class Batcher {
 public:
  Batcher(Service& service, Metrics& metrics, const Options& o)
      : service_(service), metrics_(metrics), max_batch_(size_t(o.max_batch)), max_queue_(size_t(o.max_queue)),
        worker_([this] { loop(); }) {}
  ~Batcher() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  size_t depth() {
    std::lock_guard<std::mutex> lock(m_);
    return queue_.size();
  }
  Outcome submit(const Job& job, Clock::time_point arrived) {
    Pending p{&job, arrived, {}};
    std::future<Outcome> result = p.promise.get_future();
    {
      std::lock_guard<std::mutex> lock(m_);
      if (queue_.size() >= max_queue_) {
        metrics_.rejection("queue_full");
        return {503, error_body("overloaded: the queue holds " + std::to_string(max_queue_) + " requests; retry later",
                                service_.version())};
      }
      queue_.push_back(&p);
    }
    cv_.notify_all();
    return result.get();
  }

 private:
  struct Pending {
    const Job* job;
    Clock::time_point arrived;
    std::promise<Outcome> promise;
  };

  void loop() {
    for (;;) {
      std::vector<Pending*> batch;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        while (!queue_.empty() && batch.size() < max_batch_) {
          batch.push_back(queue_.front());
          queue_.pop_front();
        }
      }
      run(batch);
    }
  }

  void run(std::vector<Pending*>& batch) {
    metrics_.batch(batch.size());
    const Clock::time_point now = Clock::now();
    std::map<std::string, std::vector<Pending*>> groups;
    std::vector<std::string> order;
    size_t alone = 0;
    for (Pending* p : batch) {
      const std::optional<double>& ms = p->job->deadline_ms;
      if (ms && now > p->arrived + std::chrono::microseconds(int64_t(*ms * 1000))) {
        metrics_.rejection("deadline");
        std::ostringstream m;
        m << "deadline of " << *ms << " ms exceeded: deadline passed in the queue; dropped before compute";
        p->promise.set_value({504, error_body(m.str(), service_.version())});
        continue;
      }
      const std::string key = p->job->group.empty() ? "\x01" + std::to_string(alone++) : p->job->group;
      if (!groups.count(key)) order.push_back(key);
      groups[key].push_back(p);
    }
    for (const std::string& key : order) answer(groups[key]);
  }

  void answer(const std::vector<Pending*>& group) {
    std::vector<const Job*> jobs;
    for (Pending* p : group) jobs.push_back(p->job);
    try {
      std::vector<Json> out = service_.run(jobs);
      for (size_t i = 0; i < group.size(); ++i) {
        out[i]["version"] = service_.version();
        group[i]->promise.set_value({200, std::move(out[i])});
      }
    } catch (const RequestError& e) {
      if (group.size() > 1) {  // isolate the bad request
        for (Pending* p : group) answer({p});
        return;
      }
      group[0]->promise.set_value({400, error_body(e.what(), service_.version())});
    } catch (const std::exception& e) {
      for (Pending* p : group) p->promise.set_value({500, error_body(e.what(), service_.version())});
    }
  }

  Service& service_;
  Metrics& metrics_;
  const size_t max_batch_, max_queue_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Pending*> queue_;
  bool stop_ = false;
  std::thread worker_;
};

// ------------------------------------------------------------------------------------------------ HTTP
int serve_http(Service& service, const Options& o) {
  Metrics metrics;
  Batcher batcher(service, metrics, o);
  std::atomic<int64_t> in_flight{0};
  httplib::Server server;
  server.new_task_queue = [&] { return new httplib::ThreadPool(size_t(o.http_threads)); };
  server.set_payload_max_length(o.max_body_bytes);
  server.set_keep_alive_max_count(1 << 30);
  server.set_tcp_nodelay(true);  // an answer goes out at once (no wait for the client's delayed ACK)
  auto send = [&](httplib::Response& res, int status, const Json& body) {
    res.status = status;
    res.set_header("x-silverrec-version", service.version());
    if (status == 503) res.set_header("Retry-After", "1");
    res.set_content(body.dump(), "application/json");
  };
  for (const char* name : {"/v1/search", "/v1/recommend", "/v1/rank"}) {
    const Route route = *route_named(name);
    const std::string path = name;
    server.Post(name, [&, route, path](const httplib::Request& req, httplib::Response& res) {
      const Clock::time_point arrived = Clock::now();
      int status = 200;
      Json body;
      try {
        Job job = service.prepare(route, Json::parse(req.body));
        if (req.has_header("X-Deadline-Ms")) {
          const std::string h = req.get_header_value("X-Deadline-Ms");
          char* end = nullptr;
          const double ms = std::strtod(h.c_str(), &end);
          if (h.empty() || *end) throw BadRequest(400, "X-Deadline-Ms must be a number of milliseconds, got '" + h + "'");
          if (!(ms > 0) || !std::isfinite(ms))
            throw BadRequest(400, "X-Deadline-Ms must be a positive number of milliseconds, got '" + h + "'");
          job.deadline_ms = ms;
        }
        ++in_flight;
        Outcome out = batcher.submit(job, arrived);
        --in_flight;
        status = out.status;
        body = std::move(out.body);
      } catch (const Json::parse_error& e) {
        status = 400;
        body = error_body(malformed(e), service.version());
      } catch (const BadRequest& e) {
        status = e.status;
        body = error_body(e.what(), service.version());
      } catch (const RequestError& e) {
        status = 400;
        body = error_body(e.what(), service.version());
      }
      send(res, status, body);
      metrics.request(path, status, std::chrono::duration<double>(Clock::now() - arrived).count());
    });
  }
  server.Get("/healthz", [&](const httplib::Request&, httplib::Response& res) {
    send(res, 200, {{"status", "ok"}, {"version", service.version()}});
  });
  server.Get("/readyz", [&](const httplib::Request&, httplib::Response& res) {
    send(res, 200, {{"status", "ready"}, {"version", service.version()}});
  });
  server.Get("/v1/model", [&](const httplib::Request&, httplib::Response& res) {
    Json info = service.model_info();
    info["serving"] = {{"max_batch", o.max_batch}, {"max_wait_ms", o.max_wait_ms}, {"max_queue", o.max_queue},
                       {"threads", o.threads ? Json(o.threads) : Json(nullptr)}};
    send(res, 200, info);
  });
  server.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.text(batcher.depth(), in_flight.load(), service.version(), service.kind()),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  if (!server.bind_to_port(o.host, o.port)) {
    std::cerr << "silverrec-predictor: cannot listen on " << o.host << ":" << o.port << "\n";
    return 1;
  }
  std::cerr << "silverrec-predictor: serving " << o.snapshot << " (" << service.version() << ") on http://" << o.host
            << ":" << o.port << "\n";
  server.listen_after_bind();
  return 0;
}

}  // namespace
}  // namespace silverrec

int main(int argc, char** argv) {
  // OpenMP reads its wait policy when it loads: passive workers, as silverrec/threads.py sets for Python's predictor
  // (a value the caller set wins); the process re-executes itself once to apply it.
  if (!std::getenv("OMP_WAIT_POLICY")) {
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    execv("/proc/self/exe", argv);
  }
  using namespace silverrec;
  const Options o = parse_args(argc, argv);
  if (o.threads) at::set_num_threads(o.threads);
  std::unique_ptr<Service> service;
  try {
    service = std::make_unique<Service>(o.snapshot);
    service->smoke();
  } catch (const SnapshotError& e) {
    std::cerr << "silverrec-predictor: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "silverrec-predictor: cannot serve " << o.snapshot << ": " << e.what() << "\n";
    return 2;
  }
  if (!o.route.empty() && o.bench_seconds > 0) return bench_lines(*service, *route_named(o.route), o);
  if (!o.route.empty()) return serve_lines(*service, *route_named(o.route));
  return serve_http(*service, o);
}
