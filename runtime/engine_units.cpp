// Engine, stage 3: gathering and releasing units (the rest of the Engine is engine.cpp and
// engine_reduce.cpp).
//
// A unit's working copy is a tensor of its own. Released, its storage holds zero bytes and
// its parameters are empty tensors; every view of it that autograd saved for backward
// shares that storage, so nothing of the unit stays allocated. Gathering allocates the
// storage again, casts this rank's FP32 master shard into its chunk and all-gathers the
// rest in place, on the comm thread, in the order gathers and reduces were queued.
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>

#include "core/error.h"
#include "runtime/engine_parts.h"
#include "runtime/kernel_dispatch.h"

namespace zerort {

void set_storage_bytes(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (nbytes == 0) {
    s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
  } else {
    ZRT_CHECK(s->allocator() != nullptr, "Engine: a stage-3 unit's storage has no allocator to refill it");
    s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  }
  s->set_nbytes(nbytes);
}

Engine::Bucket& Engine::unit(size_t index, const char* what) {
  ZRT_CHECK(options_.stage == 3, "Engine.", what, ": units are gathered and released at stage 3 only");
  ZRT_CHECK(index < buckets_.size(), "Engine.", what, ": no unit ", index, " (", buckets_.size(), " buckets)");
  return *buckets_[index];
}

void Engine::set_views(Bucket& b, bool whole) {
  c10::AutoGradMode no_grad(false);
  Group& g = *groups_[b.group];
  for (size_t j = 0; j < b.params.size(); ++j) {
    at::Tensor& p = g.params[b.params[j]];
    if (whole) {
      const auto& shape = g.shapes[b.params[j]];
      p.set_data(b.full.narrow(0, static_cast<int64_t>(b.layout.param_offset(j)),
                               static_cast<int64_t>(b.layout.param_numel(j))).view(shape));
    } else {
      p.set_data(at::empty({0}, b.full.options()));
    }
  }
}

void Engine::start_gather_locked(Bucket& b) {
  if (b.state != Bucket::State::kReleased) return;
  const size_t nbytes = b.layout.padded_numel() * dtype_size(groups_[b.group]->dtype);
  set_storage_bytes(b.full, nbytes);
  b.state = Bucket::State::kGathering;
  gathered_bytes_ += nbytes;
  gathered_peak_ = std::max(gathered_peak_, gathered_bytes_);
  queue_.push_back({Op::kGather, b.index});
  cv_.notify_all();
}

void Engine::gather_on_comm_thread(Bucket& b) {
  const DType dtype = groups_[b.group]->dtype;
  const size_t shard = b.layout.shard_numel();
  cast_from_f32_on(device_, optimizer_->master().data_ptr<float>() + b.opt_offset, own_chunk(b), dtype, shard);
  if (comm_.size() > 1) {
    comm_.all_gather(own_chunk(b), b.full.data_ptr(), shard, dtype, static_cast<int64_t>(b.index))->wait();
  }
}

void Engine::wait_gathered_locked(std::unique_lock<std::mutex>& lock, Bucket& b) {
  cv_.wait(lock, [&] { return b.state != Bucket::State::kGathering; });
  if (comm_error_) std::rethrow_exception(comm_error_);  // step() clears it
  if (!b.viewed) {
    set_views(b, true);
    b.viewed = true;
  }
}

// Note [handed-off storage]: a unit released in training empties its storage in place, so
// views autograd saved of a weight hold no bytes until the backward gather refills them. A
// unit released at the end of hold_gathered() (engine.gathered_parameters(), deepspeed's
// GatheredParameters) is for the user, who may keep what they took out inside (p.detach(),
// p.data): there the unit gets a new empty storage and the gathered one is left to its
// other owners, freed when the last of them goes (at once when there is none).
void Engine::release_locked(std::unique_lock<std::mutex>& lock, Bucket& b, bool hand_off) {
  if (b.persistent || held_ > 0 || b.state == Bucket::State::kReleased) return;
  cv_.wait(lock, [&] { return b.state != Bucket::State::kGathering; });  // the gather writes into it
  set_views(b, false);
  b.viewed = false;
  gathered_bytes_ -= static_cast<size_t>(b.full.storage().nbytes());
  if (hand_off) {
    at::Tensor empty = at::empty({0}, b.full.options());  // a storage of its own, with no bytes yet
    empty.unsafeGetTensorImpl()->set_sizes_contiguous(b.full.sizes());
    b.full = std::move(empty);
  } else {
    set_storage_bytes(b.full, 0);
  }
  b.state = Bucket::State::kReleased;
}

void Engine::prefetch(size_t index) {
  Bucket& b = unit(index, "prefetch");
  std::lock_guard<std::mutex> lock(mu_);
  start_gather_locked(b);
}

void Engine::gather(size_t index) {
  Bucket& b = unit(index, "gather");
  std::unique_lock<std::mutex> lock(mu_);
  start_gather_locked(b);
  wait_gathered_locked(lock, b);
}

void Engine::release(size_t index) {
  Bucket& b = unit(index, "release");
  std::unique_lock<std::mutex> lock(mu_);
  release_locked(lock, b);
}

void Engine::hold_gathered(bool hold) {
  ZRT_CHECK(options_.stage == 3, "Engine.hold_gathered: stage 3 only");
  std::unique_lock<std::mutex> lock(mu_);
  if (hold) {
    ++held_;
    for (Bucket* b : buckets_) start_gather_locked(*b);
    for (Bucket* b : buckets_) wait_gathered_locked(lock, *b);
    return;
  }
  ZRT_CHECK(held_ > 0, "Engine.hold_gathered(false) without a matching hold_gathered(true)");
  if (--held_ == 0) {
    for (Bucket* b : buckets_) release_locked(lock, *b, /*hand_off=*/true);
  }
}

size_t Engine::gathered_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return gathered_bytes_;
}

size_t Engine::gathered_peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return gathered_peak_;
}

void Engine::reset_gathered_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  gathered_peak_ = gathered_bytes_;
}

size_t Engine::pack_buffer_bytes() const {
  const size_t pool = pack_pool_[0].defined() ? static_cast<size_t>(pack_pool_[0].numel() + pack_pool_[1].numel()) : 0;
  return pool + overflow_peak_;
}

size_t Engine::resident_param_bytes() const {
  size_t bytes = 0;
  for (const auto& g : groups_) {
    if (g->flat_params.defined()) {
      bytes += static_cast<size_t>(g->flat_params.nbytes());
      continue;
    }
    for (const Bucket& b : g->buckets) bytes += b.persistent ? static_cast<size_t>(b.full.nbytes()) : 0;
  }
  return bytes;
}

}  // namespace zerort
