// The helper team of team.h: one process-wide set of helper threads, started lazily (at::get_num_threads()
// - 1 of them), held by one op call at a time.
#include "team.h"

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace silverrec {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kMaxIdleSpin = std::chrono::milliseconds(1);  // a helper without a step this long sleeps

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

struct Team {
  std::atomic<int> held{0};            // 1 while a call holds the team
  std::atomic<bool> in_call{false};    // helpers look for steps while set
  std::atomic<int64_t> helpers_now{0}; // helpers the holding call uses: index < helpers_now
  std::atomic<uint32_t> wake{0};       // futex word, bumped to wake sleeping helpers
  std::atomic<int> sleeping{0};
  int64_t started = 0;                 // helper threads started (by the holding call only)
  // the open step: seq odd while open; its fields are written before seq and read after it
  std::atomic<uint64_t> seq{0};
  ChunkFn fn = nullptr;
  const void* ctx = nullptr;
  int64_t n = 0, chunk = 0, chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};          // helpers inside the open step
  std::mutex error_mu;
  std::exception_ptr error;
  std::atomic<int64_t> helper_chunks{0};
};

Team* g_team = new Team;  // never destroyed: detached helpers may outlive static destruction
std::atomic<int> g_pin{-1};
thread_local int t_depth = 0;      // TeamCalls open on this thread
thread_local bool t_owner = false; // this thread's outermost TeamCall holds the team
thread_local bool t_in_step = false;
thread_local bool t_helper = false;
thread_local int64_t t_index = 0;  // 0 the calling thread, 1 + i helper i (team_probe)

// Who runs the ops' parallel steps: the team where torch's OpenMP workers sleep between regions
// (OMP_WAIT_POLICY=PASSIVE, silverrec's default: silverrec/threads.py sets it before torch loads, and
// OpenMP read it then), torch's OpenMP workers where they spin (any other policy: they keep a core busy
// between ops, and helpers of ours would contend with them for it, which slows a filtered search on a
// small VM markedly). Tests pin either, or the calling thread alone (set_team_pin).
enum class Runner { kAlone, kTeam, kOpenMP };
Runner runner() {
  static const bool passive = [] {
    const char* v = std::getenv("OMP_WAIT_POLICY");
    std::string p = v ? v : "";
    for (char& c : p) c = char(std::toupper(static_cast<unsigned char>(c)));
    return p.find("PASSIVE") != std::string::npos;
  }();
  switch (g_pin.load()) {
    case 0: return Runner::kAlone;
    case 1: return Runner::kTeam;
    case 2: return Runner::kOpenMP;
    default: return passive ? Runner::kTeam : Runner::kOpenMP;
  }
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t val) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, nullptr, nullptr, 0);
}

void wake_helpers(Team& T) {
  T.wake.fetch_add(1);
  if (T.sleeping.load() > 0) futex(&T.wake, FUTEX_WAKE_PRIVATE, INT_MAX);
}

// A helper's part of step s: chunks until none is left (or s closed before it joined).
void join_step(Team& T, uint64_t s) {
  T.active.fetch_add(1);
  if (T.seq.load() == s) {
    try {
      for (int64_t c; (c = T.next.fetch_add(1)) < T.chunks;) {
        T.fn(T.ctx, c * T.chunk, std::min(T.n, (c + 1) * T.chunk));
        T.helper_chunks.fetch_add(1, std::memory_order_relaxed);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(T.error_mu);
      if (!T.error) T.error = std::current_exception();
      T.next.store(T.chunks);  // no more chunks for anyone
    }
  }
  T.active.fetch_sub(1);
}

void helper_main(Team* team, int64_t index) {
  t_helper = true;
  t_index = 1 + index;
  omp_set_num_threads(1);  // a torch or BLAS call in a chunk stays on this thread (MKL reads it)
  Team& T = *team;
  uint64_t done = 0;
  for (;;) {
    const uint32_t w = T.wake.load();
    if (T.in_call.load() && index < T.helpers_now.load()) {
      auto idle_since = Clock::now();
      bool ended = false;
      for (int spins = 1;; ++spins) {
        if (!T.in_call.load()) {
          ended = true;
          break;
        }
        const uint64_t s = T.seq.load();
        if ((s & 1) && s != done) {
          join_step(T, s);
          done = s;
          idle_since = Clock::now();
          continue;
        }
        cpu_relax();
        if (spins % 64 == 0) {
          sched_yield();  // the core goes to any other runnable thread (torch's own workers, the server)
          if (Clock::now() - idle_since > kMaxIdleSpin) break;
        }
      }
      if (ended) continue;  // back to the top: asleep until the next call
    }
    T.sleeping.fetch_add(1);
    futex(&T.wake, FUTEX_WAIT_PRIVATE, w);  // returns at once if a wake came after w was read
    T.sleeping.fetch_sub(1);
  }
}

void after_fork_in_child() {
  g_team = new Team;  // the helpers did not survive the fork; the old team is dropped with them
  t_depth = 0;
  t_owner = false;
  t_in_step = false;
}

}  // namespace

TeamCall::TeamCall() : owner_(false) {
  if (t_depth++ > 0 || t_helper || runner() != Runner::kTeam) return;
  Team& T = *g_team;
  int free = 0;
  if (!T.held.compare_exchange_strong(free, 1)) return;  // another thread's call holds it
  owner_ = t_owner = true;
  const int64_t want = std::max<int64_t>(0, at::get_num_threads() - 1);
  static std::once_flag fork_hook;
  std::call_once(fork_hook, [] { pthread_atfork(nullptr, nullptr, after_fork_in_child); });
  try {
    for (; T.started < want; ++T.started) std::thread(helper_main, &T, T.started).detach();
  } catch (const std::system_error&) {  // no more threads to be had: the call uses those it has
  }
  const int64_t helpers = std::min(want, T.started);
  T.helpers_now.store(helpers);
  if (helpers == 0) return;
  T.in_call.store(true);
  wake_helpers(T);
}

TeamCall::~TeamCall() {
  --t_depth;
  if (!owner_) return;
  Team& T = *g_team;
  T.in_call.store(false);
  t_owner = false;
  T.held.store(0);
}

int64_t team_threads() {
  if (t_helper || t_in_step) return 1;
  const Runner r = runner();
  if (r == Runner::kAlone) return 1;
  if (r == Runner::kOpenMP) return at::in_parallel_region() ? 1 : std::max<int64_t>(1, at::get_num_threads());
  if (t_depth > 0) return t_owner ? 1 + g_team->helpers_now.load() : 1;
  return g_team->held.load() ? 1 : std::max<int64_t>(1, at::get_num_threads());
}

void team_for_chunks(int64_t n, int64_t grain, ChunkFn fn, const void* ctx) {
  const Runner r = runner();
  if (r == Runner::kAlone || t_helper || t_in_step) return fn(ctx, 0, n);
  if (r == Runner::kOpenMP) return at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) { fn(ctx, lo, hi); });
  TeamCall call;  // nests in the op's call when one is open
  const int64_t threads = team_threads();
  const int64_t chunk = std::max<int64_t>({1, grain, (n + 4 * threads - 1) / (4 * threads)});
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (threads == 1 || chunks == 1) return fn(ctx, 0, n);
  Team& T = *g_team;
  T.fn = fn;
  T.ctx = ctx;
  T.n = n;
  T.chunk = chunk;
  T.chunks = chunks;
  T.next.store(0);
  T.error = nullptr;
  const uint64_t s = T.seq.load() + 1;  // odd: open
  T.seq.store(s);
  if (T.sleeping.load() > 0) wake_helpers(T);  // one that slept through the call's wake, or timed out
  if (g_pin.load() == 1)
    for (auto t0 = Clock::now(); T.next.load() == 0 && Clock::now() - t0 < std::chrono::seconds(1);)
      if (T.sleeping.load() > 0) wake_helpers(T);
  std::exception_ptr error;
  t_in_step = true;
  try {
    for (int64_t c; (c = T.next.fetch_add(1)) < chunks;) fn(ctx, c * chunk, std::min(n, (c + 1) * chunk));
  } catch (...) {
    error = std::current_exception();
    T.next.store(chunks);
  }
  t_in_step = false;
  T.seq.store(s + 1);  // closed: no helper joins it now
  while (T.active.load() > 0) cpu_relax();
  if (!error) error = T.error;
  if (error) std::rethrow_exception(error);
}

void set_team_pin(int pin) { g_pin.store(pin); }

std::string parallel_runner() {
  switch (runner()) {
    case Runner::kAlone: return "alone";
    case Runner::kTeam: return "team";
    default: return "openmp";
  }
}

std::vector<int64_t> team_probe(int64_t n, int64_t grain, int64_t throw_at) {
  std::vector<int64_t> ran(std::max<int64_t>(n, 0), -1);
  team_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      if (i == throw_at) throw std::invalid_argument("team_probe: index " + std::to_string(i));
      team_for(0, 4, 1, [&](int64_t, int64_t) {});  // nested: on this thread
      ran[i] = ran[i] == -1 ? t_index : -2;  // -2: run twice
    }
  });
  return ran;
}
int64_t team_helper_chunks() { return g_team->helper_chunks.load(); }

}  // namespace silverrec
