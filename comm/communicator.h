// Communicator: the one interface every backend (in-process, MPI, gloo, NCCL)
// implements. Public calls pass one argument-check funnel and then reach the backend.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "comm/call_log.h"
#include "comm/work.h"
#include "core/dtype.h"

namespace zerort {

// The calls Communicator::delay_calls() slows down: gathers (all_gather) or reduces
// (all_reduce, reduce_scatter, reduce_scatter_accumulate).
enum class DelayedCalls : int32_t { kGathers = 0, kReduces = 1 };

struct CommOptions {
  // Every Work::wait() without an explicit timeout uses this.
  std::chrono::milliseconds timeout{std::chrono::seconds(600)};
  // comm.debug: every call is checked across ranks before it reaches the backend (Note
  // [checked calls]). Without it every call is recorded in calls() and the step's decision
  // exchange compares the records (runtime/step_decision.h).
  bool debug = false;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const CommOptions& options() const { return options_; }

  // Note [checked calls]: a checked call first runs one 12-value all-reduce that compares
  // every rank's collective, dtype, op, count, root and tag, so ranks that diverge get a
  // CollectiveMismatchError at that call, on every rank, naming what each rank called,
  // before any mismatched transfer. Unchecked calls are compared at the step's decision
  // instead, which names a difference only if the transport let it through: gloo aborts the
  // process and MPI truncates when the sizes differ. Ranks that diverge at stage 3 (a rank
  // that skips backward or a unit) call gathers and reduces of different sizes, so a
  // stage-3 engine turns checks on for its communicator. The check costs one blocking
  // small-message round-trip per call. Calls are checked from creation under comm.debug,
  // and from check_each_call() on: every rank must make that switch at the same point of
  // its calls (while building an engine, which is collective), and it stays on.
  void check_each_call() { checked_.store(true); }
  bool checks_each_call() const { return checked_.load(); }

  // Note [delayed calls]: a test knob, not for training. From now on every call of the kind
  // (gathers or reduces) that this rank makes sleeps `delay` in the argument-check funnel,
  // after its local checks and before its cross-rank check and the backend: on the thread
  // that calls it, which for an engine's gathers and reduces is the engine's comm thread.
  // Parity tests delay one kind on some ranks to shake out ordering races; the results must
  // stay bitwise the same. Zero turns it off; a negative delay is a ConfigError.
  void delay_calls(DelayedCalls calls, std::chrono::microseconds delay);
  std::chrono::microseconds call_delay(DelayedCalls calls) const;
  virtual const char* backend_name() const = 0;
  // The buffers it moves are device memory (nccl, or a host backend staged for CUDA).
  virtual bool device_memory() const { return false; }

  // In place: buf (count elements) becomes op over all ranks' buf.
  WorkPtr all_reduce(void* buf, size_t count, DType dtype, ReduceOp op = ReduceOp::kSum, int64_t tag = kNoTag);
  // in has size()*recv_count elements; out gets this rank's recv_count-element chunk.
  WorkPtr reduce_scatter(const void* in, void* out, size_t recv_count, DType dtype, ReduceOp op = ReduceOp::kSum);
  // in: size()*recv_count bf16, f16 (or f32) elements. out: this rank's FP32 shard. An
  // all-to-all of the chunks as they are, then a local sum in rank order 0..W-1 (see
  // local_reduce.h). accumulate=true adds into out (gradient accumulation across micro-steps).
  // tag: what the call serves (see CollectiveDesc::tag).
  WorkPtr reduce_scatter_accumulate(const void* in, DType in_dtype, float* out, size_t recv_count,
                                    bool accumulate = false, int64_t tag = kNoTag);
  // out (size()*send_count elements) gets rank r's in at offset r*send_count. `in` may be
  // this rank's own chunk of `out` (in-place all-gather).
  WorkPtr all_gather(const void* in, void* out, size_t send_count, DType dtype, int64_t tag = kNoTag);
  // in and out have size()*count elements; chunk r of in goes to rank r, chunk r of out
  // comes from rank r.
  WorkPtr all_to_all(const void* in, void* out, size_t count, DType dtype);
  WorkPtr broadcast(void* buf, size_t count, DType dtype, int root);
  WorkPtr barrier();

  // Every collective called since the step's last decision exchange (all of them, at any W).
  CallLog& calls() { return *calls_; }
  // From now on this communicator's calls go into owner's log, so the one decision exchange
  // over owner checks them too: for a part of owner's ranks that an engine calls beside it
  // (Note [hybrid sharding], runtime/shard_groups.h). Every rank makes the switch alike.
  void share_call_log(const Communicator& owner) { calls_ = owner.calls_; }
  // Collectives handed to the backend so far. At W = 1 none are: each call is the local
  // copy or conversion it amounts to (or nothing).
  int64_t backend_calls() const { return backend_calls_.load(); }

  // The most bytes of internal scratch (reduce_scatter_accumulate's received chunks) that
  // were alive at once; the memory report counts them as communication buffers.
  virtual size_t scratch_peak_bytes() const;
  virtual void reset_scratch_peak();  // start a new measurement window (an engine does, at start)

 protected:
  Communicator(int rank, int size, CommOptions options);

  // Backends implement these. Arguments are already checked; count may be 0.
  virtual WorkPtr do_all_reduce(void* buf, const CollectiveDesc& d) = 0;
  virtual WorkPtr do_reduce_scatter(const void* in, void* out, const CollectiveDesc& d) = 0;
  virtual WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) = 0;
  virtual WorkPtr do_all_to_all(const void* in, void* out, const CollectiveDesc& d) = 0;
  virtual WorkPtr do_broadcast(void* buf, const CollectiveDesc& d) = 0;
  virtual WorkPtr do_barrier(const CollectiveDesc& d) = 0;
  // Host buffers by default: an all-to-all into host scratch, then sum_chunks_to_f32 on the
  // waiting thread. Device backends (NCCL) override it to keep both halves on the device.
  virtual WorkPtr do_reduce_scatter_accumulate(const void* in, float* out, bool accumulate, const CollectiveDesc& d);

  // W = 1: the memory a collective to itself writes, without a collective (host memory
  // here; device backends override them to stay on the device).
  virtual WorkPtr local_copy(const void* in, void* out, const CollectiveDesc& d);
  virtual WorkPtr local_reduce_scatter_accumulate(const void* in, float* out, bool accumulate, const CollectiveDesc& d);

  CollectiveDesc describe(Collective kind, size_t count, DType dtype, ReduceOp op = ReduceOp::kSum, int root = 0,
                          int64_t tag = kNoTag) const;
  // Counts `bytes` of backend scratch as live (for scratch_peak_bytes) until the returned
  // token is released.
  std::shared_ptr<void> track_scratch(size_t bytes);

 private:
  // The funnel: local checks (dtype, op, root, null buffers), then the cross-rank check.
  void check(const CollectiveDesc& d, std::initializer_list<const void*> buffers);
  void check_consistent_across_ranks(const CollectiveDesc& d);
  template <typename Launch>
  WorkPtr issue(Launch&& launch) {
    ++backend_calls_;
    return launch();
  }
  WorkPtr done(const CollectiveDesc& d) const;  // a collective with nothing to do

  struct ScratchCounter;
  std::shared_ptr<char[]> allocate_scratch(size_t bytes);

  int rank_;
  int size_;
  CommOptions options_;
  std::shared_ptr<ScratchCounter> scratch_;
  std::shared_ptr<CallLog> calls_ = std::make_shared<CallLog>();
  std::atomic<int64_t> backend_calls_{0};
  std::atomic<bool> checked_;
  std::array<std::atomic<int64_t>, 2> delay_us_{};  // per DelayedCalls: See Note [delayed calls]
};

}  // namespace zerort
