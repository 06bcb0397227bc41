// The helper threads of the CPU ops' parallel steps, where torch's OpenMP workers sleep between regions
// (silverrec's default; where they spin, the steps run on them: team.cpp runner()). An op call wakes the
// helpers as it starts, and they take chunks of its steps from the moment they are awake; the calling
// thread never waits for a wake.
//
// Why not at::parallel_for (OpenMP): under OMP_WAIT_POLICY=PASSIVE, silverrec's default
// (silverrec/threads.py), each parallel region wakes the sleeping workers, and its closing barrier puts
// the caller to sleep until the last worker wakes it: two wakes a region, each an order of magnitude
// slower than a spinning worker's pickup on a small VM, and together more than a light search's whole
// step. Here the helpers' wake lands while the caller works, and the caller only spins out the chunks a
// helper holds. Helpers spin only within a call, yielding the core to
// any other runnable thread, and sleep after 1 ms without a step: nothing burns a core between requests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace silverrec {

// One op call's hold on the team, for the call's duration (RAII); it wakes the helpers at once, so that
// they are awake by the op's parallel steps. Calls nest on a thread. A call while another thread holds
// the team runs its steps alone (one op at a time per team: concurrent requests already use the cores).
class TeamCall {
 public:
  TeamCall();
  ~TeamCall();
  TeamCall(const TeamCall&) = delete;
  TeamCall& operator=(const TeamCall&) = delete;

 private:
  bool owner_;
};

// Threads a step may be split between: 1 + the helpers of the call this thread holds, at::get_num_threads()
// outside any call (team_for opens one), 1 inside a step or when another thread holds the team.
int64_t team_threads();

using ChunkFn = void (*)(const void* ctx, int64_t lo, int64_t hi);
void team_for_chunks(int64_t n, int64_t grain, ChunkFn fn, const void* ctx);

// f(lo, hi) over [begin, end) in chunks of >= grain (a few per thread, so that a helper that wakes late still
// takes a share): the calling thread takes chunks, and so does every awake helper; returns when all are
// done, rethrowing the first exception. Opens a TeamCall when none is open. f may run on a helper, whose
// OpenMP thread count is 1 (torch and BLAS calls in f run on its thread), with torch's thread-local state
// (inference mode, grad mode) at its defaults; a team_for inside f runs on f's thread.
// (at::parallel_for's signature; grain is the smallest chunk.)
template <class F>
inline void team_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  if (end - begin <= grain) return f(begin, end);
  struct Ctx {
    const F& f;
    int64_t begin;
  } ctx{f, begin};
  team_for_chunks(end - begin, grain, [](const void* c, int64_t lo, int64_t hi) {
    const Ctx& x = *static_cast<const Ctx*>(c);
    x.f(x.begin + lo, x.begin + hi);
  }, &ctx);
}

// Tests: -1 as above (the team under OMP_WAIT_POLICY=PASSIVE, else torch's OpenMP threads: team.cpp
// runner()); 0 every step on the calling thread; 1 the team, each step of several chunks waiting (up to
// 1 s) until a helper has taken one, so that the split paths run whatever the wake latency; 2 OpenMP.
void set_team_pin(int pin);
// "team", "openmp" or "alone": who runs the steps now.
std::string parallel_runner();
// Chunks run on helpers since the process started (tests check that a pinned step was shared).
int64_t team_helper_chunks();
// Tests: team_for over [0, n) in chunks of >= grain; per index, the thread that ran it (0 the caller, 1 + i
// helper i; -2 run twice), throwing std::invalid_argument at index throw_at (-1: never).
std::vector<int64_t> team_probe(int64_t n, int64_t grain, int64_t throw_at);

}  // namespace silverrec
