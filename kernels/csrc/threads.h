// The work below which one thread does a step of the CPU ops. A step runs on the helper team of team.h
// (the caller never waits for a wake; awake helpers take a chunk within microseconds) or, where torch's
// OpenMP workers spin between regions, on them (they too take a region within microseconds).
#pragma once

#include <cstdint>

namespace silverrec {

// Each threshold was chosen by timing the search ops at 1M x 96, batch 16, over varied batches, against
// its neighbours (twice and half as large); the filter and ANN benchmarks (docs/benchmarks.md) cover it.
//
// (row, query) pairs a scan offers (scan.cpp): below this, waking helpers costs more than it saves.
constexpr int64_t kMinParallelWork = int64_t{1} << 14;
// Candidate keys merged and sorted (scan.cpp), or rows x queries ranked in float (float_rank.cpp): a key's
// select and radix sort cost about ten scanned pairs, so their threshold is lower than the scan's.
constexpr int64_t kMinParallelKeys = int64_t{1} << 11;
// Filter words (64 rows each) or posting-list entries evaluated (filter_scan.cpp); a whole-pool group's words,
// or a posting-list group's entries, are split between the threads when the batch has fewer groups than
// threads.
constexpr int64_t kMinSliceWords = 4096;
// Bytes of a search's result decoded and padded (search.cpp; k 4096 x 16 queries: 768 KB, nearly all padding):
// one core's streaming stores do not fill the memory bus, so a large result is written by every thread.
constexpr int64_t kParallelResultBytes = int64_t{1} << 18;

}  // namespace silverrec
