#include "runtime/backward_check.h"

#include <string>
#include <vector>

#include "comm/error.h"

namespace zerort {

void check_backward_calls(Communicator& comm, int64_t missed, int64_t window) {
  const int world = comm.size();
  std::vector<int64_t> all(static_cast<size_t>(world), missed);
  if (world > 1) {
    try {
      comm.all_gather(&missed, all.data(), 1, DType::kInt64, kBackwardCheckTag)->wait();
    } catch (const TimeoutError&) {
      throw;
    } catch (const Error& e) {  // the cross-rank check: other ranks are elsewhere
      throw UsageError(__FILE__, __LINE__,
                       detail::concat("engine.step(): rank ", comm.rank(), " reached the end of the "
                                      "accumulation window while other ranks were still in a collective of "
                                      "backward (", missed, " of this rank's ", window, " micro-steps had no "
                                      "backward pass): call engine.backward(loss) before every engine.step() "
                                      "on every rank. ", e.message()));
    }
  }
  std::string who;
  for (int r = 0; r < world; ++r) {
    if (all[r] == 0) continue;
    who += detail::concat(who.empty() ? "" : ", ", "rank ", r, " (", all[r], " of ", window, ")");
  }
  if (who.empty()) return;
  throw UsageError(__FILE__, __LINE__,
                   detail::concat("engine.step(): a rank called step() without a backward pass since its previous "
                                  "step(): ", who, " micro-steps of this accumulation window had none; no update "
                                  "was applied and the window's gradients were dropped (on every rank). Call "
                                  "engine.backward(loss) before every engine.step() on every rank; a rank without "
                                  "data can backpropagate a zero loss (for example loss * 0)"));
}

}  // namespace zerort
