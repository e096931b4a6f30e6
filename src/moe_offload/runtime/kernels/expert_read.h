// The read of one expert from disk (expert_read.cpp), shared by read_expert (one call from Python) and the native
// prefetch queue (prefetch_queue.cpp, whose worker thread never takes the interpreter lock).

#pragma once

#include <time.h>

#include <cstdint>

namespace moe_offload {

// What one expert's read did: its requests; the CPU and wall seconds of its reads and of its staging copies; error
// 0 when done, an errno when a read failed, -1 when a file ended early (err_span: the expert's span, err_offset: the
// file byte where it did); stopped 1 when *stop ended it (the destination partly written); yields, the chunks that
// waited for on-demand reads.
struct ReadOutcome {
  int64_t requests = 0;
  double read_cpu = 0, read_wall = 0, copy_cpu = 0, copy_wall = 0;
  int64_t error = 0, err_span = -1, err_offset = 0, stopped = 0, yields = 0;
};

// Seconds on clock (CLOCK_THREAD_CPUTIME_ID: this thread's CPU; CLOCK_MONOTONIC: Python's time.perf_counter).
double now_s(clockid_t clock);

// Read spans sp [S, 4] (file index, aligned start, aligned length, bytes needed) of files fds (direct[f]: opened
// with O_DIRECT) into buf and copy pieces pc [P, 4] (span index, destination offset, offset in the span, bytes)
// from buf into out; P == 0 and buf == out: the span lands in place. chunk > 0 (a multiple of 4096): a prefetch,
// read in requests of at most chunk bytes, each after waiting while *demand > 0 and stopping once *stop is set
// (read_expert's comment). Call without the interpreter lock; the arguments are checked by the caller.
ReadOutcome read_spans(const int64_t* fds, const uint8_t* direct, const int64_t* sp, int64_t S, const int64_t* pc,
                       int64_t P, uint8_t* buf, uint8_t* out, const int32_t* demand, const int32_t* stop,
                       int64_t chunk);

}  // namespace moe_offload
