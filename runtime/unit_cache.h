// UnitCache: every bucket's low-precision working copy and the parameters that view it. At
// stages 0-2 every bucket is a persistent unit, a view of its group's flat buffer, always
// gathered. At stage 3 a unit that is not persistent has storage of its own, released
// (zero bytes) until it is gathered on use (See Note [reduce policy]).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zerort {

// Note [released storage]: a released stage-3 unit gives its memory back without dropping
// a single tensor. Its working copy's storage is resized to zero bytes in place (the
// StorageImpl stays; only its data pointer goes), and its parameters are set to empty
// tensors. Every view of the working copy, the ones autograd saved for backward included,
// shares that StorageImpl, so none of them keeps the unit's bytes alive. The gather that
// brings the unit back allocates new bytes into the same StorageImpl and writes the
// weights there, so those saved views see the weights again when backward uses them. A
// unit released at the end of hold_gathered() is the one exception: See Note [handed-off
// storage].
//
// Frees (nbytes 0) or allocates the storage behind t, keeping the StorageImpl that every
// view of t shares: See Note [released storage].
void set_storage_bytes(const at::Tensor& t, size_t nbytes);

// Note [unit cache]: a unit is kReleased, kGathering or kGathered, and moves only
// kReleased -> kGathering (begin_gather: its storage allocated, its bytes counted) ->
// kGathered (end_gather, when the gather finished or failed) -> kReleased (release: its
// parameters emptied, its bytes no longer counted). A persistent unit is always kGathered.
// What released means: See Note [released storage]. gathered_bytes() is the storage of the
// non-persistent units not released; its peak is the most since reset_peak(). While held
// (hold(), counted), or while a gather() waits for the unit (wait_for, counted per unit: a
// release racing a gather on another thread must not empty what the gather hands back),
// release() does nothing. Not thread-safe: the Engine calls it with its mutex held and waits
// out kGathering itself.
class UnitCache {
 public:
  enum class State { kReleased, kGathering, kGathered };
  struct ParamView {
    at::Tensor* param = nullptr;    // the parameter (it outlives the cache)
    int64_t offset = 0, numel = 0;  // its place in the working copy, in elements
    std::vector<int64_t> shape;
  };

  // A unit over `full` (its working copy; `bytes` of storage when gathered). A persistent
  // unit starts gathered; any other starts released. Returns its index (0, 1, ...). name:
  // for errors (See Note [unit names]), empty for units the caller did not plan.
  size_t add(at::Tensor full, size_t bytes, bool persistent, std::vector<ParamView> params, std::string name = {});

  size_t size() const { return units_.size(); }
  const at::Tensor& full(size_t u) const { return units_[u].full; }
  bool persistent(size_t u) const { return units_[u].persistent; }
  State state(size_t u) const { return units_[u].state; }
  bool gathered(size_t u) const { return units_[u].state == State::kGathered; }
  const std::string& name(size_t u) const { return units_[u].name; }

  // The parameters view the working copy (whole) or are empty tensors.
  void set_views(size_t u, bool whole);
  // kReleased -> kGathering; false (and nothing changes) in any other state.
  bool begin_gather(size_t u);
  void end_gather(size_t u);  // kGathering -> kGathered
  // After the gather: the parameters view the working copy again, if they do not yet.
  void view_gathered(size_t u);
  // kGathered -> kReleased, unless persistent, held or already released; the caller has
  // waited out kGathering. hand_off: See Note [handed-off storage] (unit_cache.cpp).
  void release(size_t u, bool hand_off = false);
  bool releasable(size_t u) const {
    return !units_[u].persistent && held_ == 0 && units_[u].waiters == 0 && units_[u].state != State::kReleased;
  }
  // A gather() waits for unit u (+1) or has its views (-1).
  void wait_for(size_t u, int delta) { units_[u].waiters += delta; }

  void hold() { ++held_; }
  bool unhold();  // true when the last hold ends
  size_t gathered_bytes() const { return gathered_bytes_; }
  size_t gathered_peak() const { return gathered_peak_; }
  void reset_peak() { gathered_peak_ = gathered_bytes_; }

 private:
  struct Unit {
    at::Tensor full;
    size_t bytes = 0;
    bool persistent = true;
    State state = State::kGathered;
    bool viewed = true;  // its parameters view `full`
    int waiters = 0;     // gather() calls waiting for it
    std::vector<ParamView> params;
    std::string name;
  };
  std::vector<Unit> units_;
  int held_ = 0;
  size_t gathered_bytes_ = 0, gathered_peak_ = 0;
};

}  // namespace zerort
