// Engine, backward's side: each gradient a hook reports is packed into its bucket (stages
// 2 and 3), a complete bucket is queued, and the comm thread runs the queue in order:
// reduce-scatters into this rank's FP32 gradient (and stage 3's gathers, engine_units.cpp).
// drain() finishes a round of reduces before the step or the next backward pass. The rest
// of the Engine is engine.cpp.
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <mutex>

#include "core/error.h"
#include "runtime/engine_parts.h"
#include "runtime/kernel_dispatch.h"

namespace zerort {

bool Engine::reducing_now() const {
  return policy_.every_micro_step || next_is_boundary();  // See Note [accumulation boundary]
}

void Engine::grad_ready(size_t g, size_t i) {
  ZRT_CHECK(g < groups_.size() && i < groups_[g]->params.size(), "Engine.grad_ready: no parameter ", i, " in group ",
            g);
  settle_update();  // the update zeroes the gradient last (Note [overlapped step])
  std::unique_lock<std::mutex> lock(mu_);
  saw_backward_ = true;
  if (!reducing_now()) return;  // stage 0/1 between boundaries: autograd keeps accumulating
  report_locked(g, i);
  Bucket& b = groups_[g]->buckets[groups_[g]->param_bucket[i]];
  take_gradient_locked(b, i);
  if (b.waiting > 0) --b.waiting;
  // A unit whose gradients are all in is not needed by this backward any more.
  if (policy_.units && b.waiting == 0) release_locked(lock, b);
  enqueue_ready_locked();
  if (local_only()) run_here_locked(lock);  // Note [W = 1 is local]
}

void Engine::report_locked(size_t g, size_t i) {
  if (reported_[g][i]) {
    throw UsageError(__FILE__, __LINE__,
                     detail::concat("Engine: parameter ", i, " of group ", g,
                                    " got a second gradient in one "
                                    "micro-step after its first was sent to be reduced: a backward pass ran "
                                    "without engine.backward() (for example loss.backward() called directly). "
                                    "Run every backward pass through engine.backward(loss), which lets several "
                                    "passes per step add up"));
  }
  reported_[g][i] = true;
  round_open_ = true;
}

void Engine::take_gradient_locked(Bucket& b, size_t param) {
  if (policy_.pack == ReducePolicy::Pack::kPooled) {
    // Move the gradient into the bucket's pack buffer now, so autograd's copy is freed
    // during backward. With no free buffer it stays put and is packed later. A bucket takes a
    // slot only when every bucket to reduce before it holds a buffer (Note [reduces in flight]).
    size_t first_without = next_to_issue_;  // at most a few steps: two slots, few one-off buffers
    while (first_without < b.index && packer_->holds(first_without)) ++first_without;
    if (first_without >= b.index && packer_->acquire(b.index)) pack_locked(b, param);
  } else if (policy_.pack == ReducePolicy::Pack::kOwnBuffer) {  // until its reduce is done
    packer_->ensure(b.index);
    pack_locked(b, param);
  }  // Pack::kNone: the gradient already lies in the group's flat buffer
}

at::TensorOptions Engine::bytes_options() const { return at::TensorOptions().dtype(at::kByte).device(device_); }

void Engine::pack_locked(Bucket& b, size_t param) {
  size_t j = 0;
  while (b.params[j] != param) ++j;
  packer_->pack(b.index, j, static_cast<int64_t>(b.layout.param_offset(j)), groups_[b.group]->params[param]);
}

void Engine::enqueue_ready_locked() {
  // Stages 0-2: strictly in bucket order, so every rank issues the same collectives in the
  // same order. Stage 3: a unit as soon as it is complete (backward's order, the same on
  // every rank; the cross-rank check compares each collective's unit).
  if (policy_.units) {
    for (Bucket* b : buckets_) {
      if (b->waiting == 0 && !b->queued) {
        b->queued = true;
        queue_.push_back({Op::kReduce, b->index});
      }
    }
  } else {
    while (next_to_queue_ < buckets_.size() && buckets_[next_to_queue_]->waiting == 0) {
      buckets_[next_to_queue_]->queued = true;
      queue_.push_back({Op::kReduce, next_to_queue_++});
    }
  }
  cv_.notify_all();
}

// Note [reduces in flight]
// The comm thread leaves a bucket's reduce in flight instead of waiting for it at once, so the
// next bucket's reduce is issued while it is still on the wire: under the two-hop pattern
// bucket k+1's hop 1 runs beside bucket k's hop 2 (Note [pipelined hops], comm/
// two_hop_communicator.h), and a flat backend has two all-to-alls on the wire.
// - The window: after each op at most kReducesInFlight - 1 reduces stay in flight (the
//   oldest are waited for first), so at most kReducesInFlight are issued and unwaited at once.
//   Two: one to overlap is what the hops need, and stage 2's pool has two pack slots; with
//   one of them held by the reduce in flight, the other stays free for backward's hooks
//   to pack the next bucket into (Note [grad packer]). A hook packs a bucket into a slot only
//   when every bucket to be reduced before it holds a buffer, so the reduce after the one in
//   flight finds its slot; should it find none (its gradients came while none was free), it
//   waits for those in flight rather than take a buffer beside the pool: the memory stays
//   the pool's.
// - A bucket's pack buffer (or, unpacked, its part of the flat gradients) is read until its
//   reduce completes: end_reduce gives the buffer back after the wait, whatever happened.
// - None is left once the round's reduces are all issued (reduced_ + in flight = buckets) or
//   the engine stops; drain() waits for reduced_, which counts a reduce once it is waited for,
//   so nothing reads the FP32 gradient (the step, zero_grad, a drain's rethrow) before.
// - Only reduces straight into the gradient in memory are left in flight. Stage 0 (a scratch
//   shard, then an all-gather), hybrid's sum across the groups, and gradients moved from the
//   host or the file wait at once: something reads each result right after it.
// - A failed wait lands in comm_error_ as a failed reduce did before (the first failure is
//   kept), and later reduces are not issued; those in flight are still waited for.
// - Progress: a backend that moves data only inside its own calls (MPI without a progress
//   thread) may finish a reduce left in flight late, at this rank's next collective or wait;
//   the round's last reduce and drain() wait for all, so none is left pending for good.
// - Same bits: each bucket's sum is its own, into its own part of the gradient.
constexpr size_t kReducesInFlight = 2;

void Engine::comm_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // W = 1: the callers run the queue themselves (Note [W = 1 is local], engine_local.cpp).
    cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !local_only()); });
    // Stopping (the engine is dropped) finishes what is queued first: every rank queued the
    // same collectives, so a peer is never left waiting in one this rank skipped.
    if (stop_ && (queue_.empty() || local_only())) {
      lock.unlock();
      settle_reduces(0);
      return;
    }
    run_next_locked(lock);
  }
}

void Engine::run_next_locked(std::unique_lock<std::mutex>& lock) {
  const auto [op, index] = queue_.front();
  queue_.pop_front();
  if (op == Op::kReduce && !policy_.units) next_to_issue_ = index + 1;
  busy_ = true;
  const auto stream = compute_stream_;  // read under mu_: set_compute_stream writes it there
  lock.unlock();
  bool in_flight = false;
  try {
    const OnComputeStream on_compute(stream);  // Note [stream order]
    if (!comm_error_) {
      if (op == Op::kReduce)
        in_flight = reduce_bucket(*buckets_[index]);
      else
        gather_on_comm_thread(*buckets_[index]);
    }
  }
  ZRT_RETHROW_FORCED_UNWIND catch (...) {
    lock.lock();
    if (!comm_error_) comm_error_ = std::current_exception();
    lock.unlock();
  }
  lock.lock();
  if (op == Op::kGather)
    units_.end_gather(index);  // gather() rethrows a failure
  else if (!in_flight)
    ++reduced_;
  const bool last = queue_.empty() && (stop_ || reduced_ + in_flight_.size() == buckets_.size());
  lock.unlock();
  settle_reduces(last ? 0 : kReducesInFlight - 1);  // See Note [reduces in flight]
  lock.lock();
  busy_ = false;
  cv_.notify_all();
}

void Engine::settle_reduces(size_t keep) {
  while (in_flight_.size() > keep) {
    auto [work, bucket] = std::move(in_flight_.front());
    try {
      end_reduce(bucket, work);
    }
    ZRT_RETHROW_FORCED_UNWIND catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!comm_error_) comm_error_ = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.pop_front();
    ++reduced_;
  }
}

bool Engine::reduce_bucket(Bucket& b) {
  const size_t shard = b.layout.shard_numel();
  OptimizerStateStore& state = optimizer_->state();
  if (replicas_ && shard > 0 && next_is_boundary()) {  // hybrid: shard_part keeps the state in memory
    reduce_bucket_across_groups(b, state.grad().data_ptr<float>() + b.opt_offset);
    return false;
  }
  // kNvme's gradient in memory is host memory: a CPU model's reduces write it directly; with
  // gradient_on_device it is the model's (Note [gradient on the device]).
  const bool reachable = !host_mover_ || options_.gradient_on_device ||
                         (options_.state_tier == StateTier::kNvme && !host_mover_->device_memory());
  if (shard == 0 || (reachable && state.gradient_in_memory())) {
    float* grad = shard == 0 ? nullptr : state.grad().data_ptr<float>() + b.opt_offset;
    if (policy_.replicated && !policy_.packs()) {  // stage 0: waited for at once
      reduce_bucket_into(b, grad);
      return false;
    }
    WorkPtr work = start_reduce(b, grad);  // See Note [reduces in flight]
    if (!work) {
      end_reduce(b.index, nullptr);
      return false;
    }
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.emplace_back(std::move(work), b.index);
    return true;
  }
  // The gradient is where the reduce cannot write: in host memory beside the model's memory
  // (kHost, kNvme) or in the file (gradient_in_file). The scratch takes this rank's gradient so
  // far, the reduce accumulates into it as into the gradient in memory (the same sums, the same
  // bits), and it goes back (See Note [state tiers]); from the file through host memory.
  float* scratch = reduce_scratch_.data_ptr<float>();
  if (host_mover_) {
    const bool in_file = !state.gradient_in_memory();
    float* grad =
        in_file ? reinterpret_cast<float*>(reduce_host_.get()) : state.grad().data_ptr<float>() + b.opt_offset;
    if (in_file) state.read_grad(b.opt_offset, shard, grad);
    host_mover_->from_host(scratch, grad, shard * sizeof(float));
    reduce_bucket_into(b, scratch);
    host_mover_->to_host(grad, scratch, shard * sizeof(float));
    if (in_file) state.write_grad(b.opt_offset, shard, grad);
    return false;
  }
  state.read_grad(b.opt_offset, shard, scratch);  // a bf16 master's, on the model's device
  reduce_bucket_into(b, scratch);
  state.write_grad(b.opt_offset, shard, scratch);
  return false;
}

void Engine::reduce_bucket_across_groups(Bucket& b, float* grad) {
  const size_t shard = b.layout.shard_numel();
  const auto tag = static_cast<int64_t>(b.index);
  if (!b.summed_across) {  // the window's gradient so far, this reduce added, then summed
    reduce_bucket_into(b, grad);
    sum_across_replicas(*replicas_, grad, shard, device_, replica_wire_, tag);
    b.summed_across = true;
    return;
  }
  // A later pass of the micro-step (or a drain after reduce_now): its part alone is summed
  // across the groups and added, so the sum stays linear (a buffer of its own, for this rare case).
  at::Tensor part = at::zeros({static_cast<int64_t>(shard)}, at::TensorOptions().dtype(at::kFloat).device(device_));
  reduce_bucket_into(b, part.data_ptr<float>());
  sum_across_replicas(*replicas_, part.data_ptr<float>(), shard, device_, replica_wire_, tag);
  at::Tensor mine = at::from_blob(grad, {static_cast<int64_t>(shard)}, part.options());
  mine.add_(part);
}

void Engine::restart_window_sums() {
  for (Bucket* b : buckets_) b->summed_across = false;
}

WorkPtr Engine::start_reduce(Bucket& b, float* grad) {
  Group& g = *groups_[b.group];
  const size_t shard = b.layout.shard_numel();
  const void* in;
  if (policy_.pack == ReducePolicy::Pack::kPooled) {
    bool starved;
    {
      std::lock_guard<std::mutex> lock(mu_);
      starved = !packer_->holds(b.index) && !packer_->slot_free();
    }
    if (starved) settle_reduces(0);  // a pool slot back, rather than a buffer beside the pool
  }
  if (policy_.packs()) {
    std::lock_guard<std::mutex> lock(mu_);  // complete: no hook touches it any more
    packer_->ensure(b.index);
    for (size_t param : b.params) pack_locked(b, param);
    in = packer_->data(b.index);
  } else {
    in = static_cast<const char*>(g.flat_grads.data_ptr()) + b.flat_offset * dtype_size(g.dtype);
  }
  if (shard == 0) return nullptr;
  if (local_only()) {  // Note [W = 1 is local]: the accumulate alone, on the compute stream
    sum_chunks_to_f32_on(device_, in, g.dtype, 1, shard, grad, true);
    return nullptr;
  }
  try {
    return shard_.reduce_scatter_accumulate(in, g.dtype, grad, shard, true, static_cast<int64_t>(b.index));
  } catch (...) {
    end_reduce(b.index, nullptr);  // the buffer goes back
    throw;
  }
}

void Engine::end_reduce(size_t bucket, const WorkPtr& work) {
  struct Release {  // the buffer goes back whatever happens
    Engine& e;
    size_t bucket;
    ~Release() {
      if (!e.policy_.packs()) return;
      std::lock_guard<std::mutex> lock(e.mu_);
      e.packer_->release(bucket);
    }
  } release{*this, bucket};
  wait_in_stream_order(work);  // Note [stream order]: the compute stream waits, not the host
}

void Engine::reduce_bucket_into(Bucket& b, float* grad) {
  if (policy_.packs() || !policy_.replicated) {  // straight into this rank's FP32 gradient shard
    end_reduce(b.index, start_reduce(b, grad));
    return;
  }
  Group& g = *groups_[b.group];
  const int64_t tag = static_cast<int64_t>(b.index);
  const size_t shard = b.layout.shard_numel();
  if (shard == 0) return;
  const void* in = static_cast<const char*>(g.flat_grads.data_ptr()) + b.flat_offset * dtype_size(g.dtype);
  if (local_only()) {  // Note [W = 1 is local]: the scratch's sum and its add are one accumulate
    sum_chunks_to_f32_on(device_, in, g.dtype, 1, shard, grad, true);
    return;
  }
  // Stage 0: reduce-scatter into a scratch shard, add it to this rank's part of the
  // replicated gradient, then all-gather that part in place so every rank holds the whole
  // sum (a bucket can be reduced more than once per step: one per backward pass).
  // On a device backend both waits are the compute stream's, and the add runs on it (Note [stream order]).
  wait_in_stream_order(
      shard_.reduce_scatter_accumulate(in, g.dtype, stage0_scratch_.data_ptr<float>(), shard, false, tag));
  const int64_t mine = static_cast<int64_t>(b.opt_offset + static_cast<size_t>(shard_.rank()) * shard);
  at::Tensor part = optimizer_->state().grad().narrow(0, mine, static_cast<int64_t>(shard));
  part.add_(stage0_scratch_.narrow(0, 0, static_cast<int64_t>(shard)));
  wait_in_stream_order(shard_.all_gather(part.data_ptr<float>(), grad, shard, DType::kFloat32, tag));
}

void Engine::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  for (Bucket* b : buckets_) b->waiting = 0;  // parameters that got no gradient this micro-step
  enqueue_ready_locked();
  if (local_only()) run_here_locked(lock);  // Note [W = 1 is local]
  cv_.wait(lock, [&] { return reduced_ == buckets_.size() && queue_.empty() && !busy_; });
  std::exception_ptr error = comm_error_;
  comm_error_ = nullptr;
  reduced_ = 0;
  next_to_queue_ = next_to_issue_ = 0;
  round_open_ = false;
  for (auto& r : reported_) r.assign(r.size(), false);
  packer_->new_round();
  for (Bucket* b : buckets_) {
    b->waiting = b->params.size();
    b->queued = false;
    if (policy_.units) release_locked(lock, *b);  // units no pass reached
  }
  lock.unlock();
  for (auto& g : groups_) {
    if (g->flat_grads.defined()) g->flat_grads.zero_();
  }
  if (error) {
    // A failed reduce leaves a half-accumulated gradient: drop this window's gradients so
    // a caller that catches and continues does not train on them.
    optimizer_->state().zero_grad();
    restart_window_sums();
    std::rethrow_exception(error);
  }
}

void Engine::begin_backward() {
  settle_update();  // the reduces write the gradient the update reads (Note [overlapped step])
  {
    std::lock_guard<std::mutex> lock(mu_);
    saw_backward_ = true;
  }
  // The previous pass's buckets are reduced (and at stages 0 and 1 its flat gradients
  // zeroed) before this pass writes any gradient: passes add up and never race.
  finish_round();
  // The window's last backward: a tier that streams the state reads ahead behind it.
  if (next_is_boundary()) optimizer_->state().prefetch();
}

void Engine::reduce_now() {
  settle_update();
  if (!reducing_now() || (replicas_ && !next_is_boundary())) {  // hybrid: summed across groups at the boundary
    throw UsageError(__FILE__, __LINE__,
                     detail::concat("the gradients are reduced in the accumulation window's last micro-step at stage ",
                                    options_.stage, replicas_ ? " with shard_size" : "", " (micro-step ",
                                    micro_step_in_window() + 1, " of ", options_.optimizer.gradient_accumulation_steps,
                                    " now): ask for them after "
                                    "that micro-step's backward, before its step()"));
  }
  finish_round();
}

void Engine::finish_round() {
  bool open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    open = round_open_;
  }
  if (open) drain();  // a drain zeroes what it reduced: a second one adds nothing
}

}  // namespace zerort
