// CallLog: what a communicator was asked to do since the last step, so the step's one
// decision exchange can check that every rank issued the same collectives (see
// runtime/step_decision.h) without a round-trip per collective.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "comm/work.h"

namespace zerort {

// One call as the cross-rank checks compare it: kind, dtype, op, count, root, tag.
using CallFields = std::array<int64_t, 6>;
CallFields call_fields(const CollectiveDesc& d);
// "reduce_scatter_accumulate(count=8, dtype=bf16, tag=3) on rank 1 of 2" from a rank's fields.
std::string describe_call(const CallFields& f, int rank, int world);

class CallLog {
 public:
  // The first kKept calls are kept to name the first difference; the fingerprint and the
  // count cover every call.
  static constexpr size_t kKept = 4096;

  struct Summary {
    int64_t calls = 0;
    int64_t fingerprint = 0;  // order-sensitive 64-bit hash of every call's fields
  };

  void record(const CollectiveDesc& d);  // thread-safe
  Summary summary() const;
  std::vector<CallFields> kept() const;
  void clear();  // a new window: the step's decision starts one

 private:
  mutable std::mutex mu_;
  Summary summary_;
  std::vector<CallFields> kept_;
};

}  // namespace zerort
