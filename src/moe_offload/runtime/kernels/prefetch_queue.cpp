// The disk tier's prefetch queue in native code (runtime/native_prefetch.py, issue 47 session 49): a worker thread
// that reads queued experts from disk into their pool slots, one at a time, FIFO, and never takes the interpreter
// lock. runtime/transfer.py's worker ran 0.2-0.3 ms of Python around each 0.1 ms read (scripts/read_cpu_cost.py),
// holding the lock the computing thread needs; here a job is read by expert_read.cpp's read_spans and its landing
// is kept until the main thread collects it (poll / wait), which also carries the worker's CPU seconds by role.
//
// The protocol is runtime/transfer.py's TransferEngine (SeqMoE 8.3): submit enqueues (eid, slot, tag); copies start
// in submission order, except that wait moves a queued copy to the front (behind copies waited for earlier) and
// starts it even while paused; cancel drops a queued copy (it lands cancelled) or stops a running one at its next
// chunk; each landing is reported once, by wait when the caller waited for that copy, else by poll.

#include <torch/extension.h>

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "expert_read.h"

namespace py = pybind11;

namespace {

constexpr int kQueued = 0, kRunning = 1, kDone = 2;
// a landing's status
constexpr int64_t kOk = 0, kCancelled = 1, kFailed = 2;

struct Job {
  int64_t seq, eid, slot, tag;
  bool on_demand;
  bool urgent = false;
  int state = kQueued;
  int32_t stop = 0;  // read_spans polls it between chunks
  double started = -1.0;
};

// (seq, eid, slot, tag, status, on_demand, error, err_span, err_offset, started (-1: never), finished)
using Landed = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                          double>;

}  // namespace

class PrefetchQueue {
 public:
  // fds / direct: the store's files; span_index int64 [N + 1] and piece_index int64 [N + 1]: expert e's rows of spans
  // int64 [T, 4] and pieces int64 [Q, 4] (read_expert's layouts; an expert without pieces is read in place, straight
  // into its slot); slots uint8 [num_slots, row bytes] (the pool); staging uint8 (page-aligned, the longest staged
  // span); demand int32 [1] (the store's outstanding on-demand reads); chunk: bytes per prefetch request (a multiple
  // of 4096); cpus: the worker's cores (empty: any); realtime: run it under SCHED_FIFO.
  PrefetchQueue(std::vector<int64_t> fds, std::vector<bool> direct, torch::Tensor span_index, torch::Tensor spans,
                torch::Tensor piece_index, torch::Tensor pieces, torch::Tensor slots, torch::Tensor staging,
                torch::Tensor demand, int64_t chunk, std::vector<int64_t> cpus, bool realtime)
      : fds_(std::move(fds)), direct_(direct.begin(), direct.end()), span_index_(span_index), spans_(spans),
        piece_index_(piece_index), pieces_(pieces), slots_(slots), staging_(staging), demand_(demand),
        chunk_(chunk) {
    for (const auto& t : {span_index, spans, piece_index, pieces})
      TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(),
                  "PrefetchQueue: plans int64, contiguous, on the CPU");
    TORCH_CHECK(span_index.numel() == piece_index.numel() && span_index.numel() >= 1, "PrefetchQueue: plan indices");
    TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kByte && slots.is_contiguous() && slots.device().is_cpu(),
                "PrefetchQueue: slots uint8 [S, B] on the CPU");
    TORCH_CHECK(staging.scalar_type() == at::kByte && staging.is_contiguous() && staging.device().is_cpu(),
                "PrefetchQueue: staging uint8 on the CPU");
    TORCH_CHECK(demand.scalar_type() == at::kInt && demand.numel() >= 1 && demand.device().is_cpu(),
                "PrefetchQueue: demand int32 [1]");
    TORCH_CHECK(chunk > 0 && chunk % 4096 == 0, "PrefetchQueue: chunk a positive multiple of 4096");
    TORCH_CHECK(fds_.size() == direct_.size(), "PrefetchQueue: one direct flag per file");
    num_experts_ = span_index.numel() - 1;
    const int64_t* si = span_index.data_ptr<int64_t>();
    const int64_t* pi = piece_index.data_ptr<int64_t>();
    const int64_t* sp = spans.data_ptr<int64_t>();
    const int64_t* pc = pieces.data_ptr<int64_t>();
    const int64_t row = slots.size(1), cap = staging.numel();
    read_bytes_.assign(num_experts_, 0);
    field_bytes_.assign(num_experts_, 0);
    for (int64_t e = 0; e < num_experts_; ++e) {
      TORCH_CHECK(si[e] <= si[e + 1] && si[e + 1] <= spans.size(0) && pi[e] <= pi[e + 1] &&
                  pi[e + 1] <= pieces.size(0), "PrefetchQueue: plan indices");
      const bool in_place = pi[e] == pi[e + 1];
      for (int64_t s = si[e]; s < si[e + 1]; ++s) {
        TORCH_CHECK(sp[4 * s] >= 0 && sp[4 * s] < static_cast<int64_t>(fds_.size()) && sp[4 * s + 3] <= sp[4 * s + 2]
                    && sp[4 * s + 2] <= (in_place ? row : cap), "PrefetchQueue: a span's file or length");
        read_bytes_[e] += sp[4 * s + 2];
        if (in_place) field_bytes_[e] += sp[4 * s + 2];
      }
      TORCH_CHECK(!in_place || si[e + 1] - si[e] <= 1, "PrefetchQueue: an expert read in place has one span");
      for (int64_t p = pi[e]; p < pi[e + 1]; ++p) {
        const int64_t s = pc[4 * p], d = pc[4 * p + 1], o = pc[4 * p + 2], n = pc[4 * p + 3];
        TORCH_CHECK(s >= 0 && s < si[e + 1] - si[e] && d >= 0 && o >= 0 && n >= 0 && d + n <= row &&
                    o + n <= sp[4 * (si[e] + s) + 2], "PrefetchQueue: a piece outside its span or the slot");
        field_bytes_[e] += n;
      }
    }
    worker_ = std::thread([this, cpus, realtime] { run(cpus, realtime); });
  }

  // Never closed from Python (or its close timed out): the running read is stopped at its next chunk, and the
  // interpreter lock released while the worker ends, since a read yielding to a miss waits for Python to end it.
  ~PrefetchQueue() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (current_) __atomic_store_n(&current_->stop, 1, __ATOMIC_RELEASE);
    }
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release release;
      shut(false, -1.0);
    } else {
      shut(false, -1.0);
    }
  }

  int64_t num_experts() const { return num_experts_; }

  // Enqueue a copy of expert eid into slot; 0: queued, 1: the queue is closed, 2: a copy of eid is queued or running.
  int64_t submit(int64_t eid, int64_t slot, int64_t tag, bool on_demand) {
    TORCH_CHECK(eid >= 0 && eid < num_experts_ && slot >= 0 && slot < slots_.size(0),
                "PrefetchQueue.submit: expert or slot out of range");
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return 1;
    if (active_.count(eid)) return 2;
    auto job = std::make_shared<Job>(Job{next_seq_++, eid, slot, tag, on_demand});
    active_[eid] = job;
    queue_.push_back(job);
    ++counts_[kSubmitted];
    counts_[kMaxQueued] = std::max<int64_t>(counts_[kMaxQueued], queue_.size());
    cv_.notify_all();
    return 0;
  }

  // The landings not yet reported, in completion order.
  std::vector<Landed> poll() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<Landed> out;
    out.swap(done_);
    return out;
  }

  // Block (without the interpreter lock) until eid's copy lands; (0, landing): its landing, consumed; (1, _): no copy
  // of eid queued, running or unreported; (2, _): timeout_s (>= 0) passed first (the copy stays where it is). A queued
  // copy moves to the front, behind the copies waited for before it, and starts even while paused.
  std::tuple<int64_t, Landed> wait(int64_t eid, double timeout_s) {
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lk(mu_);
    auto it = active_.find(eid);
    if (it == active_.end()) {
      for (size_t i = 0; i < done_.size(); ++i)
        if (std::get<1>(done_[i]) == eid) {
          Landed l = done_[i];
          done_.erase(done_.begin() + i);
          return {0, l};
        }
      return {1, Landed{}};
    }
    std::shared_ptr<Job> job = it->second;
    if (job->state == kQueued && !job->urgent) {
      job->urgent = true;
      queue_.erase(std::find(queue_.begin(), queue_.end(), job));
      auto at = queue_.begin();
      while (at != queue_.end() && (*at)->urgent) ++at;
      queue_.insert(at, job);
      cv_.notify_all();
    }
    auto landed = [&] { return job->state == kDone; };
    if (timeout_s < 0) {
      cv_.wait(lk, landed);
    } else if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), landed)) {
      return {2, Landed{}};
    }
    for (size_t i = 0; i < done_.size(); ++i)
      if (std::get<0>(done_[i]) == job->seq) {
        Landed l = done_[i];
        done_.erase(done_.begin() + i);
        return {0, l};
      }
    return {1, Landed{}};  // not reached: a job's landing stays in done_ until reported
  }

  // Drop eid's queued copy (true; it lands cancelled), or stop its running copy at the next chunk (false).
  bool cancel(int64_t eid) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = active_.find(eid);
    if (it == active_.end()) return false;
    std::shared_ptr<Job> job = it->second;
    if (job->state == kRunning) __atomic_store_n(&job->stop, 1, __ATOMIC_RELEASE);
    if (job->state != kQueued) return false;
    queue_.erase(std::find(queue_.begin(), queue_.end(), job));
    finish(*job, kCancelled, moe_offload::ReadOutcome{});
    return true;
  }

  void pause() {
    std::lock_guard<std::mutex> lk(mu_);
    paused_ = true;
  }

  void resume() {
    std::lock_guard<std::mutex> lk(mu_);
    paused_ = false;
    cv_.notify_all();
  }

  bool paused() {
    std::lock_guard<std::mutex> lk(mu_);
    return paused_;
  }

  // Experts whose copy is queued (in start order) and the one running (-1: none).
  std::tuple<std::vector<int64_t>, int64_t> jobs() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<int64_t> q;
    for (const auto& j : queue_) q.push_back(j->eid);
    return {q, current_ ? current_->eid : -1};
  }

  int64_t outstanding() {
    std::lock_guard<std::mutex> lk(mu_);
    return static_cast<int64_t>(active_.size());
  }

  bool pending(int64_t eid) {
    std::lock_guard<std::mutex> lk(mu_);
    return active_.count(eid) > 0;
  }

  // Counters since the last reset: (submitted, copies, cancelled, failed, max_queued, prefetch_copies, requests,
  // bytes_read, field_bytes, in_place, yields, stopped) and seconds (busy (landing - start), prefetch_cpu, and by
  // role the worker thread's CPU and wall: prefetch reads, on-demand reads, staging copies).
  std::tuple<std::vector<int64_t>, std::vector<double>> stats() {
    std::lock_guard<std::mutex> lk(mu_);
    return {counts_, seconds_};
  }

  // stats() as they were, and zeroed under the same lock (no read ending in between is lost).
  std::tuple<std::vector<int64_t>, std::vector<double>> reset_stats() {
    std::lock_guard<std::mutex> lk(mu_);
    std::tuple<std::vector<int64_t>, std::vector<double>> taken{counts_, seconds_};
    std::fill(counts_.begin(), counts_.end(), 0);
    std::fill(seconds_.begin(), seconds_.end(), 0.0);
    return taken;
  }

  // Stop accepting copies and join the worker: drain runs the queued copies first (a pause no longer holds them),
  // else they land cancelled; the running copy completes either way. False when the worker did not exit within
  // timeout_s (>= 0).
  bool close(bool drain, double timeout_s) {
    py::gil_scoped_release release;
    return shut(drain, timeout_s);
  }

  bool closed() {
    std::lock_guard<std::mutex> lk(mu_);
    return closed_;
  }

  bool alive() {
    std::lock_guard<std::mutex> lk(mu_);
    return !exited_;
  }

 private:
  // counts_ and seconds_ positions (stats())
  enum { kSubmitted, kCopies, kCancelledN, kFailedN, kMaxQueued, kPrefetchCopies, kRequests, kBytesRead,
         kFieldBytes, kInPlace, kYields, kStopped, kCounts };
  enum { kBusy, kPrefetchCpu, kPrefetchReadCpu, kPrefetchReadWall, kDemandReadCpu, kDemandReadWall, kCopyCpu,
         kCopyWall, kSeconds };

  // close() without touching the interpreter lock (the destructor's too).
  bool shut(bool drain, double timeout_s) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      closed_ = true;
      if (drain) {
        paused_ = false;
      } else {
        while (!queue_.empty()) {
          auto job = queue_.front();
          queue_.pop_front();
          finish(*job, kCancelled, moe_offload::ReadOutcome{});
        }
      }
      stop_ = true;
      cv_.notify_all();
      auto exited = [&] { return exited_; };
      if (timeout_s < 0) {
        cv_.wait(lk, exited);
      } else if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), exited)) {
        return false;
      }
    }
    if (worker_.joinable()) worker_.join();
    return true;
  }

  void run(const std::vector<int64_t>& cpus, bool realtime) {
#ifdef __linux__
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int64_t c : cpus) CPU_SET(static_cast<int>(c), &set);
      sched_setaffinity(0, sizeof(set), &set);
    }
    if (realtime) {
      sched_param prio{};
      prio.sched_priority = 1;
      pthread_setschedparam(pthread_self(), SCHED_FIFO, &prio);
    }
#endif
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] {
        return (!queue_.empty() && (!paused_ || stop_ || queue_.front()->urgent)) || (stop_ && queue_.empty());
      });
      if (queue_.empty()) break;
      std::shared_ptr<Job> job = queue_.front();
      queue_.pop_front();
      job->state = kRunning;
      current_ = job;
      job->started = moe_offload::now_s(CLOCK_MONOTONIC);
      lk.unlock();
      const double c0 = moe_offload::now_s(CLOCK_THREAD_CPUTIME_ID), w0 = moe_offload::now_s(CLOCK_MONOTONIC);
      const int64_t* si = span_index_.data_ptr<int64_t>();
      const int64_t* pi = piece_index_.data_ptr<int64_t>();
      const int64_t e = job->eid, P = pi[e + 1] - pi[e];
      uint8_t* row = slots_.data_ptr<uint8_t>() + job->slot * slots_.size(1);
      moe_offload::ReadOutcome r = moe_offload::read_spans(
          fds_.data(), direct_.data(), spans_.data_ptr<int64_t>() + 4 * si[e], si[e + 1] - si[e],
          pieces_.data_ptr<int64_t>() + 4 * pi[e], P, P ? staging_.data_ptr<uint8_t>() : row, row,
          demand_.data_ptr<int32_t>(), &job->stop, chunk_);
      const double cpu = moe_offload::now_s(CLOCK_THREAD_CPUTIME_ID) - c0;
      const double wall = moe_offload::now_s(CLOCK_MONOTONIC) - w0;
      lk.lock();
      const bool demand = job->on_demand || job->urgent;  // a copy a layer waits for is on its critical path
      seconds_[demand ? kDemandReadCpu : kPrefetchReadCpu] += cpu - r.copy_cpu;
      seconds_[demand ? kDemandReadWall : kPrefetchReadWall] += wall - r.copy_wall;
      seconds_[kCopyCpu] += r.copy_cpu, seconds_[kCopyWall] += r.copy_wall;
      counts_[kRequests] += r.requests, counts_[kYields] += r.yields;
      const int64_t status = r.error ? kFailed : r.stopped ? kCancelled : kOk;
      if (status == kOk) {
        counts_[kBytesRead] += read_bytes_[e], counts_[kFieldBytes] += field_bytes_[e];
        counts_[kInPlace] += P == 0;
        if (!job->on_demand) ++counts_[kPrefetchCopies], seconds_[kPrefetchCpu] += cpu;
      } else if (status == kCancelled) {
        ++counts_[kStopped];
      }
      finish(*job, status, r);
    }
    exited_ = true;
    cv_.notify_all();
  }

  // Record job's landing (mu_ held); the first caller wins.
  void finish(Job& job, int64_t status, const moe_offload::ReadOutcome& r) {
    if (job.state == kDone) return;
    const double now = moe_offload::now_s(CLOCK_MONOTONIC);
    job.state = kDone;
    done_.emplace_back(job.seq, job.eid, job.slot, job.tag, status, job.on_demand, r.error, r.err_span, r.err_offset,
                       job.started, now);
    if (current_.get() == &job) current_.reset();
    if (job.started >= 0) {
      seconds_[kBusy] += now - job.started;
      if (status == kOk) ++counts_[kCopies];
      else if (status == kFailed) ++counts_[kFailedN];
    }
    if (status == kCancelled) ++counts_[kCancelledN];
    active_.erase(job.eid);  // may free job: last
    cv_.notify_all();
  }

  std::vector<int64_t> fds_;
  std::vector<uint8_t> direct_;
  torch::Tensor span_index_, spans_, piece_index_, pieces_, slots_, staging_, demand_;
  int64_t chunk_, num_experts_ = 0;
  std::vector<int64_t> read_bytes_, field_bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Job>> active_;
  std::shared_ptr<Job> current_;
  std::vector<Landed> done_;
  int64_t next_seq_ = 0;
  std::vector<int64_t> counts_ = std::vector<int64_t>(kCounts, 0);
  std::vector<double> seconds_ = std::vector<double>(kSeconds, 0.0);
  bool paused_ = false, closed_ = false, stop_ = false, exited_ = false;
  std::thread worker_;
};

void bind_prefetch_queue(py::module_& m) {
  py::class_<PrefetchQueue>(m, "PrefetchQueue", "the disk tier's prefetch queue, read by a native worker thread")
      .def(py::init<std::vector<int64_t>, std::vector<bool>, torch::Tensor, torch::Tensor, torch::Tensor,
                    torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, std::vector<int64_t>, bool>(),
           py::arg("fds"), py::arg("direct"), py::arg("span_index"), py::arg("spans"), py::arg("piece_index"),
           py::arg("pieces"), py::arg("slots"), py::arg("staging"), py::arg("demand"), py::arg("chunk"),
           py::arg("cpus"), py::arg("realtime"))
      .def("num_experts", &PrefetchQueue::num_experts, "N, the experts it can read")
      .def("submit", &PrefetchQueue::submit, "enqueue (eid, slot, tag, on_demand): 0 queued, 1 closed, 2 a duplicate")
      .def("poll", &PrefetchQueue::poll, "the landings not yet reported: (seq, eid, slot, tag, status 0 ok / 1 "
           "cancelled / 2 failed, on_demand, errno or -1, error span, error offset, started, finished)")
      .def("wait", &PrefetchQueue::wait, "(eid, timeout_s < 0: none) -> (0 landing, 1 none, 2 timeout; landing), "
           "without the GIL")
      .def("cancel", &PrefetchQueue::cancel, "drop a queued copy (True) or stop a running one at its next chunk")
      .def("pause", &PrefetchQueue::pause, "start no new copy until resume (a waited copy still starts)")
      .def("resume", &PrefetchQueue::resume, "let queued copies start again")
      .def("paused", &PrefetchQueue::paused, "whether paused")
      .def("jobs", &PrefetchQueue::jobs, "(queued experts in start order, the running one or -1)")
      .def("outstanding", &PrefetchQueue::outstanding, "copies queued or running")
      .def("pending", &PrefetchQueue::pending, "whether a copy of eid is queued or running")
      .def("stats", &PrefetchQueue::stats, "(counts, seconds) since the last reset: prefetch_queue.cpp's stats()")
      .def("reset_stats", &PrefetchQueue::reset_stats, "stats() as they were, zeroed under one lock")
      .def("close", &PrefetchQueue::close, "(drain, timeout_s): stop and join the worker; False on timeout")
      .def("closed", &PrefetchQueue::closed, "whether closed")
      .def("alive", &PrefetchQueue::alive, "whether the worker thread runs");
}
