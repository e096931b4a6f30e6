// One expert read from disk in one call (runtime/disk_store.py, issue 47 part 2): its aligned spans read into the
// reading thread's staging buffer and its fields copied from there into the destination, with the interpreter lock
// released for the whole expert. In Python each of an expert's requests needed the lock back between reads, and
// waited for it while the main thread ran Python. A prefetch is one call too (session 47): its yields to on-demand
// reads and its cancellation are flags checked between its chunks, not Python between them.

#include <torch/extension.h>

#include "expert_read.h"

#include <fcntl.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kAlign = 4096;  // runtime/direct_io.py: IO_ALIGN

// Sleep while *flag == value (at most 5 ms: the caller checks its stop flag again), woken by futex_wake. Without
// futexes (not Linux), a 200 us nap.
void wait_while(const int32_t* flag, int32_t value) {
#ifdef __linux__
  const timespec most{0, 5000000};
  syscall(SYS_futex, flag, FUTEX_WAIT_PRIVATE, value, &most, nullptr, 0);
#else
  const timespec nap{0, 200000};
  nanosleep(&nap, nullptr);
#endif
}

}  // namespace

namespace moe_offload {

double now_s(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

ReadOutcome read_spans(const int64_t* fds, const uint8_t* direct, const int64_t* sp, int64_t S, const int64_t* pc,
                       int64_t P, uint8_t* buf, uint8_t* out, const int32_t* demand_p, const int32_t* stop_p,
                       int64_t chunk) {
  ReadOutcome r;
  const bool chunked = chunk > 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t f = sp[4 * s], start = sp[4 * s + 1], length = sp[4 * s + 2], need = sp[4 * s + 3];
    const int fd = static_cast<int>(fds[f]);
    double c0 = now_s(CLOCK_THREAD_CPUTIME_ID), w0 = now_s(CLOCK_MONOTONIC);
    int64_t got = 0;
    while (got < need) {
      int64_t want = length - got;
      if (chunked) {  // a prefetch: yield to on-demand reads, stop when cancelled, then one chunk
        if (__atomic_load_n(demand_p, __ATOMIC_ACQUIRE) > 0) {
          ++r.yields;
          for (int32_t v; (v = __atomic_load_n(demand_p, __ATOMIC_ACQUIRE)) > 0 &&
                          !__atomic_load_n(stop_p, __ATOMIC_ACQUIRE);)
            wait_while(demand_p, v);
        }
        if (__atomic_load_n(stop_p, __ATOMIC_ACQUIRE)) {
          r.stopped = 1;
          break;
        }
        want = std::min(want, chunk);
      }
      ssize_t n = pread(fd, buf + got, static_cast<size_t>(want), start + got);
      if (n < 0 && errno == EINTR) continue;
      ++r.requests;
      if (n < 0) {
        r.error = errno, r.err_span = s, r.err_offset = start + got;
        break;
      }
      if (n == 0 || (direct[f] && n % kAlign && got + n < need)) {
        r.error = -1, r.err_span = s, r.err_offset = start + got + n;
        break;
      }
      got += n;
    }
    if (!r.error && !direct[f]) posix_fadvise(fd, start, length, POSIX_FADV_DONTNEED);
    r.read_cpu += now_s(CLOCK_THREAD_CPUTIME_ID) - c0, r.read_wall += now_s(CLOCK_MONOTONIC) - w0;
    if (r.error || r.stopped) break;
    c0 = now_s(CLOCK_THREAD_CPUTIME_ID), w0 = now_s(CLOCK_MONOTONIC);
    for (int64_t p = 0; p < P; ++p)
      if (pc[4 * p] == s) std::memcpy(out + pc[4 * p + 1], buf + pc[4 * p + 2], static_cast<size_t>(pc[4 * p + 3]));
    r.copy_cpu += now_s(CLOCK_THREAD_CPUTIME_ID) - c0, r.copy_wall += now_s(CLOCK_MONOTONIC) - w0;
  }
  return r;
}

}  // namespace moe_offload

// Wake the native reads sleeping on flag (int32 [1]; read_expert's demand): the disk store calls it when its last
// outstanding on-demand read ends.
void futex_wake(torch::Tensor flag) {
  TORCH_CHECK(flag.scalar_type() == at::kInt && flag.numel() >= 1 && flag.device().is_cpu(),
              "futex_wake: an int32 flag on the CPU");
#ifdef __linux__
  syscall(SYS_futex, flag.data_ptr<int32_t>(), FUTEX_WAKE_PRIVATE, 1 << 30, nullptr, nullptr, 0);
#endif
}

// fds [F], direct [F] (opened with O_DIRECT: a short read not at the end is an error; else the span is dropped from
// the page cache after its read), spans int64 [S, 4] (file index, aligned start, aligned length, bytes needed),
// pieces int64 [P, 4] (span index, destination offset, offset in the span, bytes), staging uint8 (page-aligned, at
// least the longest span), dst uint8 (contiguous, on the CPU).
//
// A prefetch (runtime/disk_store.py: read_prefetch) passes demand and stop, int32 [1] flags the store and the
// transfer engine write from Python, and chunk > 0 (a multiple of 4096 bytes): each span is then read in requests of
// at most chunk bytes, and before each one the read sleeps while *demand, the store's count of outstanding on-demand
// reads, is above zero (a futex the store wakes: futex_wake; a 5 ms timeout re-checks stop), then stops if *stop
// is set: a miss never queues behind more than one chunk of a prefetch. Without them the spans are read whole.
//
// Returns (requests, read CPU s, read wall s, copy CPU s, copy wall s, error, error span, error offset, stopped,
// yields): error 0 when done, an errno when a read failed, -1 when a file ended early (error offset: the file byte
// where it did); stopped 1 when *stop ended the read (dst partly written); yields, the chunks that waited for
// on-demand reads.
std::tuple<int64_t, double, double, double, double, int64_t, int64_t, int64_t, int64_t, int64_t> read_expert(
    std::vector<int64_t> fds, std::vector<bool> direct, torch::Tensor spans, torch::Tensor pieces,
    torch::Tensor staging, torch::Tensor dst, c10::optional<torch::Tensor> demand, c10::optional<torch::Tensor> stop,
    int64_t chunk) {
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 4 && spans.scalar_type() == at::kLong && spans.is_contiguous(),
              "read_expert: spans int64 [S, 4]");
  TORCH_CHECK(pieces.dim() == 2 && pieces.size(1) == 4 && pieces.scalar_type() == at::kLong &&
              pieces.is_contiguous(), "read_expert: pieces int64 [P, 4]");
  TORCH_CHECK(staging.scalar_type() == at::kByte && dst.scalar_type() == at::kByte && staging.is_contiguous() &&
              dst.is_contiguous() && staging.device().is_cpu() && dst.device().is_cpu(),
              "read_expert: staging and dst contiguous uint8 on the CPU");
  TORCH_CHECK(fds.size() == direct.size(), "read_expert: one direct flag per file");
  const bool chunked = chunk > 0;
  TORCH_CHECK(!chunked || (chunk % kAlign == 0 && demand.has_value() && stop.has_value()),
              "read_expert: a chunked read needs chunk a multiple of 4096 bytes, demand and stop");
  for (const auto* flag : {&demand, &stop})
    TORCH_CHECK(!flag->has_value() || ((*flag)->scalar_type() == at::kInt && (*flag)->numel() >= 1 &&
                                       (*flag)->device().is_cpu()), "read_expert: demand and stop int32 [1] flags");
  const int32_t* demand_p = demand.has_value() ? demand->data_ptr<int32_t>() : nullptr;
  const int32_t* stop_p = stop.has_value() ? stop->data_ptr<int32_t>() : nullptr;
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t* pc = pieces.data_ptr<int64_t>();
  const int64_t S = spans.size(0), P = pieces.size(0), cap = staging.numel(), dst_n = dst.numel();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(sp[4 * s] >= 0 && sp[4 * s] < static_cast<int64_t>(fds.size()), "read_expert: a span's file index");
    TORCH_CHECK(sp[4 * s + 2] <= cap && sp[4 * s + 3] <= sp[4 * s + 2], "read_expert: a span longer than staging");
  }
  for (int64_t p = 0; p < P; ++p) {
    const int64_t s = pc[4 * p], d = pc[4 * p + 1], o = pc[4 * p + 2], n = pc[4 * p + 3];
    TORCH_CHECK(s >= 0 && s < S && d >= 0 && o >= 0 && n >= 0 && d + n <= dst_n && o + n <= sp[4 * s + 2],
                "read_expert: a piece outside its span or the destination");
  }
  moe_offload::ReadOutcome r;
  {
    pybind11::gil_scoped_release release;
    std::vector<uint8_t> direct_b(direct.begin(), direct.end());
    r = moe_offload::read_spans(fds.data(), direct_b.data(), sp, S, pc, P,
                                staging.data_ptr<uint8_t>(), dst.data_ptr<uint8_t>(), demand_p, stop_p,
                                chunked ? chunk : 0);
  }
  return {r.requests, r.read_cpu, r.read_wall, r.copy_cpu, r.copy_wall, r.error, r.err_span, r.err_offset, r.stopped,
          r.yields};
}
