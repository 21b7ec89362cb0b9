#include "runtime/unit_cache.h"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>

#include "core/error.h"

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

size_t UnitCache::add(at::Tensor full, size_t bytes, bool persistent, std::vector<ParamView> params, std::string name) {
  Unit u;
  u.full = std::move(full);
  u.bytes = bytes;
  u.persistent = persistent;
  u.params = std::move(params);
  u.name = std::move(name);
  if (!persistent) {  // starts released: gathered on use
    set_storage_bytes(u.full, 0);
    u.state = State::kReleased;
    u.viewed = false;
  }
  units_.push_back(std::move(u));
  return units_.size() - 1;
}

void UnitCache::set_views(size_t i, bool whole) {
  c10::AutoGradMode no_grad(false);
  Unit& u = units_[i];
  for (ParamView& v : u.params) {
    if (whole) {
      v.param->set_data(u.full.narrow(0, v.offset, v.numel).view(v.shape));
    } else {
      v.param->set_data(at::empty({0}, u.full.options()));
    }
  }
}

bool UnitCache::begin_gather(size_t i) {
  Unit& u = units_[i];
  if (u.state != State::kReleased) return false;
  set_storage_bytes(u.full, u.bytes);
  u.state = State::kGathering;
  gathered_bytes_ += u.bytes;
  gathered_peak_ = std::max(gathered_peak_, gathered_bytes_);
  return true;
}

void UnitCache::end_gather(size_t i) { units_[i].state = State::kGathered; }

void UnitCache::view_gathered(size_t i) {
  if (units_[i].viewed) return;
  set_views(i, true);
  units_[i].viewed = true;
}

// Note [handed-off storage]: a unit released in training empties its storage in place (See
// Note [released storage], unit_cache.h). A unit released at the end of hold_gathered()
// (engine.gathered_parameters(), deepspeed's GatheredParameters) is for the user, who may
// keep what they took out inside (p.detach(), p.data): there the unit gets a new empty
// storage and the gathered one is left to its other owners, freed when the last of them
// goes (at once when there is none).
void UnitCache::release(size_t i, bool hand_off) {
  Unit& u = units_[i];
  if (!releasable(i)) return;
  set_views(i, false);
  u.viewed = false;
  gathered_bytes_ -= static_cast<size_t>(u.full.storage().nbytes());
  if (hand_off) {
    at::Tensor empty = at::empty({0}, u.full.options());  // a storage of its own, with no bytes yet
    empty.unsafeGetTensorImpl()->set_sizes_contiguous(u.full.sizes());
    u.full = std::move(empty);
  } else {
    set_storage_bytes(u.full, 0);
  }
  u.state = State::kReleased;
}

bool UnitCache::unhold() {
  ZRT_CHECK(held_ > 0, "Engine.hold_gathered(false) without a matching hold_gathered(true)");
  return --held_ == 0;
}

}  // namespace zerort
