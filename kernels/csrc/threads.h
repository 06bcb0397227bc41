// When the CPU search ops use torch's intra-op threads (at::parallel_for): the work below which one thread
// does a step, per OpenMP wait policy.
//
// Each parallel region costs a hand-over to the other workers. Workers that spin after a region (the
// OpenMP default) take the next one within ~4 us; workers that sleep (OMP_WAIT_POLICY=PASSIVE, silverrec's
// default: silverrec/threads.py) must be woken, ~70 us a region on the 2-vCPU benchmark VM (a parallel
// torch.add of 40k floats: 4.4 vs 72 us). So a light search (a few hundred matching rows: 0.15-0.3 ms)
// is split between threads only where workers spin; under PASSIVE the same splits ran it 2.5x slower.
// (On that VM the PASSIVE cost depends on what the caller did before the region, in a one-off C++ probe
// of an empty region: 52-64 us right after another region, ~4 us after 10-40 us of serial work, 65-100 us
// after 150 us or more of it, as a search's first region after its Python prelude. One region per call,
// whose worker picks up tasks only once it has woken, would pay the wake off the caller's path.)
#pragma once

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace silverrec {

// True when OMP_WAIT_POLICY is PASSIVE (any case), as OpenMP read it when torch loaded (silverrec sets it
// before importing torch; silverrec/threads.py OMP_PASSIVE reads the same variable). Tests pin either
// answer (set_workers_sleep: 1 sleeping, 0 spinning, -1 the environment's) to run both thresholds.
inline int& workers_sleep_pin() {
  static int pin = -1;
  return pin;
}
inline void set_workers_sleep(int pin) { workers_sleep_pin() = pin; }
inline bool workers_sleep() {
  static const bool passive = [] {
    const char* v = std::getenv("OMP_WAIT_POLICY");
    std::string s = v ? v : "";
    for (char& c : s) c = char(std::toupper(static_cast<unsigned char>(c)));
    return s.find("PASSIVE") != std::string::npos;
  }();
  const int pin = workers_sleep_pin();
  return pin < 0 ? passive : pin == 1;
}

// A threshold with one value for spinning workers and one for sleeping ones.
struct MinParallel {
  int64_t spinning, sleeping;
  int64_t operator()() const { return workers_sleep() ? sleeping : spinning; }
};

// 1M x 96, batch 16, in one process over varied batches, workers spinning; the sleeping values are the
// thresholds measured under PASSIVE in session 16 (or "never" at the sizes a search reaches).
//
// (row, query) pairs a scan offers (scan.cpp): against 1 << 16, unfiltered nprobe 4 0.696 -> 0.566 ms, a
// 0.2% filter's 2,000 rows 0.530 -> 0.487 ms; 1 << 13 was no better.
constexpr MinParallel kMinParallelWork{int64_t{1} << 14, int64_t{1} << 16};
// Candidate keys merged and sorted (scan.cpp), or rows x queries ranked in float (float_rank.cpp): a key's
// select and radix sort cost ~10x a scanned pair. k 4096, against the scan's threshold: 241 matches (3,856
// keys) 0.207 -> 0.189 ms, 612 matches 0.345 -> 0.312 ms (512: no better); the float ranking (k 100): 241
// matches 0.211 -> 0.193 ms, 612 matches 0.330 -> 0.268 ms.
constexpr MinParallel kMinParallelKeys{int64_t{1} << 11, int64_t{1} << 16};
// Filter words (64 rows each) or posting-list entries evaluated (filter_scan.cpp); a whole-pool group's words
// are split between the threads when the batch has fewer groups than threads: one 3-value AND, 241 matches,
// 0.156 -> 0.139 ms at k 100, 0.178 -> 0.157 ms at k 4096; 612 matches 0.222 -> 0.204 ms.
constexpr MinParallel kMinSliceWords{4096, int64_t{1} << 17};
// Bytes of a search's result decoded and padded (ops.cpp; k 4096 x 16 queries: 768 KB, nearly all padding):
// one core's streaming stores do not fill the memory bus: 241 matches 0.239 -> 0.219 ms, 612: 0.375 -> 0.348.
constexpr MinParallel kParallelResultBytes{int64_t{1} << 18, int64_t{1} << 23};

}  // namespace silverrec
