// ParamGathers: the all-gathers that make buckets' working copies whole again after an
// update, each by its bucket, until someone waits for it.
//
// Note [overlapped parameter gather]: at stages 1 and 2 each bucket's gather starts as soon
// as AdamW has written this rank's chunk of it (its output segment closes). Without
// overlap_param_gather the update waits for all of them before step() returns, keeping at
// most kWindow in flight (a staged communicator holds staging buffers for each one in
// flight). With it, step() returns with every gather in flight, and the next forward waits
// for each bucket's gather only when a module holding its parameters is about to run
// (python/zerort/engine/param_waits.py). Every gather writes the same bytes whenever it is
// waited for, so the bits are those of the waiting run. Until then a bucket's working copy
// holds other ranks' chunks of the previous step: anything that reads or writes working
// copies outside a forward waits first (Engine::wait_param_gathers: step(), refresh_params(),
// the destructor; in Python the state methods and the modules' state_dict()). On a device
// backend each wait is the compute stream's (Note [stream order], comm/stream_order.h), not
// the host's: what reads or writes a working copy after it is device work on that stream.
#pragma once

#include <cstddef>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "comm/work.h"

namespace zerort {

class ParamGathers {
 public:
  static constexpr size_t kWindow = 2;  // in flight at most when not overlapped

  // w: bucket's gather, just started. Not overlapped, the oldest is waited for first when
  // kWindow are in flight.
  void start(size_t bucket, WorkPtr w, bool overlapped);
  void wait(size_t bucket);               // bucket's gather is done (a no-op when none is in flight)
  void wait_all();                        // every one, oldest first; errors after all are taken out
  std::vector<size_t> in_flight() const;  // buckets whose gather nobody has waited for, oldest first

 private:
  WorkPtr take(size_t bucket);                        // its Work, removed (nullptr when none)
  mutable std::mutex mu_;                             // waits happen outside it
  std::deque<std::pair<size_t, WorkPtr>> in_flight_;  // oldest first
};

}  // namespace zerort
