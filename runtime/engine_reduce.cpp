// Engine, backward's side: each gradient a hook reports is packed into its bucket (stages
// 2 and 3), a complete bucket is queued, and the comm thread runs the queue in order:
// reduce-scatters into this rank's FP32 gradient (and stage 3's gathers, engine_units.cpp).
// drain() finishes a round of reduces before the step or the next backward pass. The rest
// of the Engine is engine.cpp.
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <mutex>

#include "core/error.h"
#include "runtime/engine_parts.h"

namespace zerort {

bool Engine::reducing_now() const {
  return options_.stage >= 2 || (micro_steps_ + 1) % options_.optimizer.gradient_accumulation_steps == 0;
}

void Engine::grad_ready(size_t g, size_t i) {
  ZRT_CHECK(g < groups_.size() && i < groups_[g]->params.size(), "Engine.grad_ready: no parameter ", i,
            " in group ", g);
  std::unique_lock<std::mutex> lock(mu_);
  saw_backward_ = true;
  if (!reducing_now()) return;  // stage 0/1 between boundaries: autograd keeps accumulating
  if (reported_[g][i]) {
    throw UsageError(__FILE__, __LINE__,
                     detail::concat("Engine: parameter ", i, " of group ", g, " got a second gradient in one "
                                    "micro-step after its first was sent to be reduced: a backward pass ran "
                                    "without engine.backward() (for example loss.backward() called directly). "
                                    "Run every backward pass through engine.backward(loss), which lets several "
                                    "passes per step add up"));
  }
  reported_[g][i] = true;
  round_open_ = true;
  Bucket& b = groups_[g]->buckets[groups_[g]->param_bucket[i]];
  if (options_.stage == 2) {
    // Stage 2: move the gradient into the bucket's pack buffer now, so autograd's copy is
    // freed during backward. With no free buffer it stays put and is packed later.
    if (b.slot < 0) b.slot = acquire_slot_locked(b);
    if (b.slot >= 0) pack_locked(b, i);
  } else if (options_.stage == 3) {  // a unit's own pack buffer, until its reduce is done
    ensure_pack_buffer_locked(b);
    pack_locked(b, i);
  }
  if (b.waiting > 0) --b.waiting;
  // Stage 3: a unit whose gradients are all in is not needed by this backward any more.
  if (options_.stage == 3 && b.waiting == 0) release_locked(lock, b);
  enqueue_ready_locked();
}

void Engine::ensure_pack_buffer_locked(Bucket& b) {
  if (b.slot >= 0 || b.overflow.defined()) return;
  b.slot = acquire_slot_locked(b);
  if (b.slot >= 0) return;
  // Stage 3, or stage 2 with gradients out of bucket order (never wait for a later bucket).
  const size_t bytes = b.layout.padded_numel() * dtype_size(groups_[b.group]->dtype);
  b.overflow = at::zeros({static_cast<int64_t>(bytes)}, bytes_options());
  overflow_peak_ = std::max(overflow_peak_, bytes);
}

int Engine::acquire_slot_locked(Bucket& b) {
  for (int s = 0; s < 2 && pack_pool_[0].defined(); ++s) {
    if (slot_owner_[s] == nullptr) {
      slot_owner_[s] = &b;
      const size_t bytes = b.layout.padded_numel() * dtype_size(groups_[b.group]->dtype);
      pack_pool_[s].narrow(0, 0, static_cast<int64_t>(bytes)).zero_();  // padding and missing grads are 0
      return s;
    }
  }
  return -1;
}

void* Engine::pack_buffer(Bucket& b) {
  return b.slot >= 0 ? pack_pool_[b.slot].data_ptr() : b.overflow.data_ptr();
}

at::TensorOptions Engine::bytes_options() const { return at::TensorOptions().dtype(at::kByte).device(device_); }

void Engine::pack_locked(Bucket& b, size_t param) {
  Group& g = *groups_[b.group];
  size_t j = 0;
  while (b.params[j] != param) ++j;
  if (b.packed[j]) return;
  at::Tensor& p = g.params[param];
  if (p.grad().defined()) {
    const int64_t off = static_cast<int64_t>(b.layout.param_offset(j));
    const at::Tensor& bytes = b.slot >= 0 ? pack_pool_[b.slot] : b.overflow;
    at::Tensor pack = bytes.narrow(0, 0, static_cast<int64_t>(b.layout.padded_numel() * dtype_size(g.dtype)))
                          .view(scalar_type(g.dtype));
    pack.narrow(0, off, p.numel()).copy_(p.grad().reshape({-1}));
    p.mutable_grad() = at::Tensor();  // autograd's buffer is freed here
  }
  b.packed[j] = true;
}

void Engine::enqueue_ready_locked() {
  // Stages 0-2: strictly in bucket order, so every rank issues the same collectives in the
  // same order. Stage 3: a unit as soon as it is complete (backward's order, the same on
  // every rank; the cross-rank check compares each collective's unit).
  if (options_.stage == 3) {
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

void Engine::comm_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    // Stopping (the engine is dropped) finishes what is queued first: every rank queued the
    // same collectives, so a peer is never left waiting in one this rank skipped.
    if (stop_ && queue_.empty()) return;
    const auto [op, index] = queue_.front();
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    try {
      if (!comm_error_) {
        if (op == Op::kReduce) reduce_bucket(*buckets_[index]);
        else gather_on_comm_thread(*buckets_[index]);
      }
    } ZRT_RETHROW_FORCED_UNWIND catch (...) {
      lock.lock();
      if (!comm_error_) comm_error_ = std::current_exception();
      lock.unlock();
    }
    lock.lock();
    busy_ = false;
    if (op == Op::kReduce) ++reduced_;
    else buckets_[index]->state = Bucket::State::kGathered;  // gather() rethrows a failure
    cv_.notify_all();
  }
}

void Engine::reduce_bucket(Bucket& b) {
  Group& g = *groups_[b.group];
  const int64_t tag = static_cast<int64_t>(b.index);
  const size_t shard = b.layout.shard_numel();
  float* grad = optimizer_->grad_shard().data_ptr<float>() + b.opt_offset;
  if (sharded_grads()) {
    {
      std::lock_guard<std::mutex> lock(mu_);  // complete: no hook touches it any more
      ensure_pack_buffer_locked(b);
      for (size_t param : b.params) pack_locked(b, param);
    }
    struct Release {  // the buffer goes back whatever happens
      Engine& e;
      Bucket& b;
      ~Release() {
        std::lock_guard<std::mutex> lock(e.mu_);
        if (b.slot >= 0) e.slot_owner_[b.slot] = nullptr;
        b.slot = -1;
        b.overflow = at::Tensor();
      }
    } release{*this, b};
    if (shard > 0) comm_.reduce_scatter_accumulate(pack_buffer(b), g.dtype, grad, shard, true, tag)->wait();
    return;
  }
  if (shard == 0) return;
  const void* in = static_cast<const char*>(g.flat_grads.data_ptr()) + b.flat_offset * dtype_size(g.dtype);
  if (options_.stage != 0) {  // straight into this rank's FP32 gradient shard
    comm_.reduce_scatter_accumulate(in, g.dtype, grad, shard, true, tag)->wait();
    return;
  }
  // Stage 0: reduce-scatter into a scratch shard, add it to this rank's part of the
  // replicated gradient, then all-gather that part in place so every rank holds the whole
  // sum (a bucket can be reduced more than once per step: one per backward pass).
  comm_.reduce_scatter_accumulate(in, g.dtype, stage0_scratch_.data_ptr<float>(), shard, false, tag)->wait();
  const int64_t mine = static_cast<int64_t>(b.opt_offset + static_cast<size_t>(comm_.rank()) * shard);
  at::Tensor part = optimizer_->grad_shard().narrow(0, mine, static_cast<int64_t>(shard));
  part.add_(stage0_scratch_.narrow(0, 0, static_cast<int64_t>(shard)));
  comm_.all_gather(part.data_ptr<float>(), grad, shard, DType::kFloat32, tag)->wait();
}

void Engine::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  for (Bucket* b : buckets_) b->waiting = 0;  // parameters that got no gradient this micro-step
  enqueue_ready_locked();
  cv_.wait(lock, [&] { return reduced_ == buckets_.size() && queue_.empty() && !busy_; });
  std::exception_ptr error = comm_error_;
  comm_error_ = nullptr;
  reduced_ = 0;
  next_to_queue_ = 0;
  round_open_ = false;
  for (auto& r : reported_) r.assign(r.size(), false);
  for (Bucket* b : buckets_) {
    b->waiting = b->params.size();
    b->packed.assign(b->params.size(), false);
    b->queued = false;
    if (options_.stage == 3) release_locked(lock, *b);  // units no pass reached
  }
  lock.unlock();
  for (auto& g : groups_) {
    if (g->flat_grads.defined()) g->flat_grads.zero_();
  }
  if (error) {
    // A failed reduce leaves a half-accumulated gradient: drop this window's gradients so
    // a caller that catches and continues does not train on them.
    optimizer_->grad_shard().zero_();
    std::rethrow_exception(error);
  }
}

void Engine::begin_backward() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    saw_backward_ = true;
  }
  // The previous pass's buckets are reduced (and at stages 0 and 1 its flat gradients
  // zeroed) before this pass writes any gradient: passes add up and never race.
  finish_round();
}

void Engine::reduce_now() {
  if (!reducing_now()) {
    throw UsageError(__FILE__, __LINE__,
                     detail::concat("the gradients are reduced in the accumulation window's last micro-step at stage ",
                                    options_.stage, " (micro-step ", micro_steps_ % options_.optimizer.
                                    gradient_accumulation_steps + 1, " of ", options_.optimizer.
                                    gradient_accumulation_steps, " now): ask for them after that micro-step's "
                                    "backward, before its step()"));
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
