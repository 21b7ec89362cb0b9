// Engine, stage 3: gathering and releasing units (the rest of the Engine is engine.cpp and
// engine_reduce.cpp). Their states, storage and views are the UnitCache's (See Note [unit
// cache]); here the Engine queues the gathers and waits for them.
//
// Gathering allocates a unit's storage again, casts this rank's FP32 master shard into its
// chunk and all-gathers the rest in place, on the comm thread, in the order gathers and
// reduces were queued.
#include "core/error.h"
#include "runtime/engine_parts.h"
#include "runtime/kernel_dispatch.h"

namespace zerort {

Engine::Bucket& Engine::unit(size_t index, const char* what) {
  ZRT_CHECK(policy_.units, "Engine.", what, ": units are gathered and released at stage 3 only");
  ZRT_CHECK(index < buckets_.size(), "Engine.", what, ": no unit ", index, " (", buckets_.size(), " buckets)");
  return *buckets_[index];
}

void Engine::start_gather_locked(Bucket& b) {
  if (!units_.begin_gather(b.index)) return;
  queue_.push_back({Op::kGather, b.index});
  cv_.notify_all();
}

void Engine::gather_on_comm_thread(Bucket& b) {
  const at::Tensor& full = units_.full(b.index);
  const DType dtype = groups_[b.group]->dtype;
  if (secondary_ && secondary_->holds(b.index)) {  // Note [secondary shards]: within the node
    secondary_->gather(b.index, full, dtype, static_cast<int64_t>(b.index));
    return;
  }
  // A prefetch may run ahead (Note [overlapped step]); at W = 1 it runs on the caller's thread.
  step_overlap_.wait(b.index, local_only() ? Waiter::kCaller : Waiter::kCommThread);
  fill_own_chunk(b);
  if (shard_.size() > 1) wait_in_stream_order(gather_working_copy(b));  // Note [stream order]
  if (secondary_ && !units_.persistent(b.index)) secondary_->keep(b.index, full);
}

void Engine::wait_gathered_locked(std::unique_lock<std::mutex>& lock, Bucket& b) {
  units_.wait_for(b.index, +1);  // no release() empties it meanwhile (See Note [unit cache])
  cv_.wait(lock, [&] { return units_.state(b.index) != UnitCache::State::kGathering; });
  units_.wait_for(b.index, -1);
  if (comm_error_) std::rethrow_exception(comm_error_);  // step() clears it
  units_.view_gathered(b.index);
}

void Engine::release_locked(std::unique_lock<std::mutex>& lock, Bucket& b, bool hand_off) {
  if (!units_.releasable(b.index)) return;
  // The gather writes into it; a gather() waiting for it keeps it (See Note [unit cache]).
  cv_.wait(lock, [&] { return units_.state(b.index) != UnitCache::State::kGathering; });
  if (units_.releasable(b.index)) units_.release(b.index, hand_off);
}

void Engine::prefetch(size_t index) {
  Bucket& b = unit(index, "prefetch");
  naming_units([&] {
    std::unique_lock<std::mutex> lock(mu_);
    start_gather_locked(b);
    if (local_only()) run_here_locked(lock);  // Note [W = 1 is local]
  });
}

void Engine::gather(size_t index) {
  Bucket& b = unit(index, "gather");
  step_overlap_.wait(index);  // the forward's wait for its update (Note [overlapped step])
  naming_units([&] {
    std::unique_lock<std::mutex> lock(mu_);
    start_gather_locked(b);
    if (local_only()) run_here_locked(lock);  // Note [W = 1 is local]
    wait_gathered_locked(lock, b);
  });
}

void Engine::release(size_t index) {
  Bucket& b = unit(index, "release");
  std::unique_lock<std::mutex> lock(mu_);
  release_locked(lock, b);
}

void Engine::hold_gathered(bool hold) {
  ZRT_CHECK(policy_.units, "Engine.hold_gathered: stage 3 only");
  settle_update();
  std::unique_lock<std::mutex> lock(mu_);
  if (hold) {
    units_.hold();
    for (Bucket* b : buckets_) start_gather_locked(*b);
    if (local_only()) run_here_locked(lock);  // Note [W = 1 is local]
    for (Bucket* b : buckets_) wait_gathered_locked(lock, *b);
    return;
  }
  if (units_.unhold()) {
    for (Bucket* b : buckets_) release_locked(lock, *b, /*hand_off=*/true);
  }
}

size_t Engine::gathered_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return units_.gathered_bytes();
}

size_t Engine::gathered_peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return units_.gathered_peak();
}

void Engine::reset_gathered_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  units_.reset_peak();
}

size_t Engine::pack_buffer_bytes() const { return packer_->buffer_bytes(); }

size_t Engine::resident_param_bytes() const {
  size_t bytes = 0;
  for (const auto& g : groups_) {
    if (g->flat_params.defined()) {
      bytes += static_cast<size_t>(g->flat_params.nbytes());
      continue;
    }
    for (const Bucket& b : g->buckets) {
      bytes += units_.persistent(b.index) ? static_cast<size_t>(units_.full(b.index).nbytes()) : 0;
    }
  }
  // The shard copies of Note [state tiers], and hpZ's pieces (Note [secondary shards]).
  return bytes + shard_copies_.memory_bytes() + (secondary_ ? secondary_->bytes() : 0);
}

}  // namespace zerort
