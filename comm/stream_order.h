// StreamOrder: the one place that records and waits events for the engine's device work.
//
//   order.set_compute(s);          // the stream the user's work is on (torch's current stream)
//   order.side_after_compute(c);   // a collective on stream c reads what the user's work wrote
//   ... the collective on c ..., then record `done` on c (order.record(done, c))
//   order.compute_after(done);     // the user's later work reads what it wrote: a stream wait
//   order.host_wait(e, HostWait::kStepDecision);  // only where the host needs a value
//
// Streams templates: anything with the types Stream and Event and these calls (the CUDA
// runtime's in comm/cuda_streams.h, a fake one in tests/cpp/test_stream_order.cpp):
//   Event make_event(); void record(Event, Stream); void wait(Stream, Event);
//   void synchronize(Event);  // blocks the host
//
// Note [stream order]
// - Every engine collective, copy and kernel is queued after the work queued on the compute
//   stream when it is issued (side_after_compute before the side stream's work; kernels go on
//   the compute stream itself). A conservative order: the comm thread may record the input
//   event later than the hook that queued the work, never earlier.
// - The user's later work follows the engine's by compute_after (cudaStreamWaitEvent): the
//   host does not wait for a reduce or a gather. A transfer's deadline is then watched off the
//   step (Note [stream-waited work], comm/deadline_watchdog.h).
// - The compute stream, one per device for the process, is whatever an engine was last told at
//   an entry (construction, forward, backward, step, the state calls: python/zerort/engine/
//   streams.py); until then the legacy default stream, PyTorch's default stream. A micro-step's
//   forward, backward and step run on one stream (autograd packs the gradients on the forward's).
//
// Note [allowed host waits]: host_wait() is the only host wait of the engine's device path, and
// each reason is one of these, counted per reason (tests/gpu/test_gpu_streams.py counts them):
// - kStepDecision: the step's decision needs the non-finite count, the squared norm and the
//   loss scale on the host (a few bytes, once per accumulation boundary);
// - kUserCall: a value a user asked for (state_dict, checkpoints, GatheredParameters, grad());
// - kStagedCopy: a host backend (mpi, gloo, shm) staged for CUDA buffers, or the host tier
//   beside a CUDA model, moves host memory: each copy between the device and its pinned
//   staging waits for the copy (comm/staged_cuda.cpp). The nccl backend makes none.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <utility>

namespace zerort {

enum class HostWait : int { kStepDecision = 0, kUserCall = 1, kStagedCopy = 2 };
inline constexpr int kHostWaitReasons = 3;

template <typename Streams>
class StreamOrder {
 public:
  using Stream = typename Streams::Stream;
  using Event = typename Streams::Event;

  explicit StreamOrder(Streams streams, Stream initial) : streams_(std::move(streams)), compute_(initial) {}
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

  // The stream the user's work is on now: the engine's kernels go on it, its side streams
  // order after it. Thread-safe.
  void set_compute(Stream s) {
    std::lock_guard<std::mutex> lock(mu_);
    compute_ = s;
  }
  Stream compute() const {
    std::lock_guard<std::mutex> lock(mu_);
    return compute_;
  }

  // `side`'s later work starts after what the compute stream has queued so far. Nothing is
  // recorded when side is the compute stream itself (stream order already holds).
  void side_after_compute(Stream side) {
    std::lock_guard<std::mutex> lock(mu_);
    if (side == compute_) return;
    if (!have_input_) {
      input_ = streams_.make_event();
      have_input_ = true;
    }
    // One event serves every call: a wait takes the record made just before it, under mu_.
    streams_.record(input_, compute_);
    streams_.wait(side, input_);
  }

  // Records `done` on `side` (the end of the engine's work there).
  void record(Event done, Stream side) { streams_.record(done, side); }

  // The compute stream's later work starts after `done`: a stream wait, never a host wait.
  void compute_after(Event done) {
    std::lock_guard<std::mutex> lock(mu_);
    streams_.wait(compute_, done);
  }

  // The host blocks until `e` has happened: only for a reason in Note [allowed host waits].
  void host_wait(Event e, HostWait why) {
    ++host_waits_[static_cast<int>(why)];
    streams_.synchronize(e);
  }
  // Counts a host wait that another layer makes for `why` (a kernel that returns a value).
  void count_host_wait(HostWait why) { ++host_waits_[static_cast<int>(why)]; }
  int64_t host_waits(HostWait why) const { return host_waits_[static_cast<int>(why)].load(); }

  Streams& streams() { return streams_; }

 private:
  Streams streams_;
  mutable std::mutex mu_;
  Stream compute_;
  Event input_{};
  bool have_input_ = false;
  std::array<std::atomic<int64_t>, kHostWaitReasons> host_waits_{};
};

}  // namespace zerort
