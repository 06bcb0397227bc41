// The work below which one thread does a step of the CPU ops. A step runs on the helper team of team.h
// (the caller never waits for a wake; awake helpers take a chunk within ~4 us) or, where torch's OpenMP
// workers spin between regions, on them (they too take a region within ~4 us).
#pragma once

#include <cstdint>

namespace silverrec {

// 1M x 96, batch 16, in one process over varied batches, with workers that took a step within ~4 us
// (spinning OpenMP workers; team.h's helpers spin within a call).
//
// (row, query) pairs a scan offers (scan.cpp): against 1 << 16, unfiltered nprobe 4 0.696 -> 0.566 ms, a
// 0.2% filter's 2,000 rows 0.530 -> 0.487 ms; 1 << 13 was no better.
constexpr int64_t kMinParallelWork = int64_t{1} << 14;
// Candidate keys merged and sorted (scan.cpp), or rows x queries ranked in float (float_rank.cpp): a key's
// select and radix sort cost ~10x a scanned pair. k 4096, against the scan's threshold: 241 matches (3,856
// keys) 0.207 -> 0.189 ms, 612 matches 0.345 -> 0.312 ms (512: no better); the float ranking (k 100): 241
// matches 0.211 -> 0.193 ms, 612 matches 0.330 -> 0.268 ms.
constexpr int64_t kMinParallelKeys = int64_t{1} << 11;
// Filter words (64 rows each) or posting-list entries evaluated (filter_scan.cpp); a whole-pool group's words,
// or a posting-list group's entries, are split between the threads when the batch has fewer groups than
// threads: one 3-value AND, 241 matches, 0.156 -> 0.139 ms at k 100, 0.178 -> 0.157 ms at k 4096; 612 matches
// 0.222 -> 0.204 ms.
constexpr int64_t kMinSliceWords = 4096;
// Bytes of a search's result decoded and padded (search.cpp; k 4096 x 16 queries: 768 KB, nearly all padding):
// one core's streaming stores do not fill the memory bus: 241 matches 0.239 -> 0.219 ms, 612: 0.375 -> 0.348.
constexpr int64_t kParallelResultBytes = int64_t{1} << 18;

}  // namespace silverrec
