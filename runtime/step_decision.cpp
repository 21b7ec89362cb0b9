#include "runtime/step_decision.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"

namespace zerort {

namespace {

constexpr size_t kRow = 5;  // nonfinite, sum_squares (bits), missed, calls, fingerprint
constexpr size_t kFields = std::tuple_size<CallFields>::value;

int64_t bits(double x) {
  int64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
double from_bits(int64_t b) {
  double x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// Every rank's row: this rank fills its own, the others stay 0, and a sum all-reduce makes
// it an all-gather on any backend (NCCL stages host buffers for all-reduce only).
std::vector<int64_t> gather_rows(Communicator& comm, const int64_t* mine, size_t row) {
  // On the heap, kept by the Work: a backend may still write into it after a timeout.
  auto all = std::make_shared<std::vector<int64_t>>(row * static_cast<size_t>(comm.size()), 0);
  std::copy_n(mine, row, all->begin() + static_cast<std::ptrdiff_t>(row * static_cast<size_t>(comm.rank())));
  if (comm.size() > 1) {
    WorkPtr w = comm.all_reduce(all->data(), all->size(), DType::kInt64, ReduceOp::kSum, kStepDecisionTag);
    w->keep_alive(all);
    w->wait();
  }
  return *all;
}

// Ranks called different collectives: name the first call that differs, from every
// rank's kept calls (one more all-gather, on this rare path only).
[[noreturn]] void throw_first_difference(Communicator& comm, const std::vector<int64_t>& rows,
                                         std::vector<CallFields> kept, int64_t my_calls) {
  const int world = comm.size();
  int64_t most = 0;
  for (int r = 0; r < world; ++r) most = std::max(most, rows[r * kRow + 3]);
  const size_t listed = std::min(static_cast<size_t>(most), CallLog::kKept);
  kept.resize(std::min(kept.size(), static_cast<size_t>(my_calls)));  // not the decision's own call
  std::vector<int64_t> mine(listed * kFields, 0);                     // kind 0: no call there
  for (size_t i = 0; i < kept.size() && i < listed; ++i) std::copy(kept[i].begin(), kept[i].end(), &mine[i * kFields]);
  const std::vector<int64_t> all = gather_rows(comm, mine.data(), mine.size());
  auto call = [&](int r, size_t i) {
    CallFields f;
    std::copy_n(&all[(static_cast<size_t>(r) * listed + i) * kFields], kFields, f.begin());
    return f;
  };
  size_t first = listed;
  for (size_t i = 0; i < listed && first == listed; ++i) {
    for (int r = 1; r < world; ++r) {
      if (call(r, i) != call(0, i)) first = i;
    }
  }
  std::string who;
  constexpr int kNamed = 16;
  for (int r = 0; r < world && r < kNamed; ++r) {
    const CallFields f = call(r, first < listed ? first : 0);
    const bool none = first >= listed || f[0] == 0;
    who +=
        detail::concat("\n  rank ", r, ": ",
                       none ? detail::concat("(", rows[r * kRow + 3], " calls in all)") : describe_call(f, r, world));
  }
  if (world > kNamed) who += detail::concat("\n  (", world - kNamed, " more ranks)");
  const std::string where =
      first < listed
          ? detail::concat("call ", first + 1, " since the previous step is the first that differs. Each rank's call:")
          : detail::concat("the first ", listed, " calls agree; a later one differs. Each rank's count:");
  throw UsageError(__FILE__, __LINE__,
                   detail::concat("engine.step(): ranks called different collectives since the previous step "
                                  "(ranks took different paths through the model, or called zerort.comm on some "
                                  "ranks only); every rank must issue the same collectives in the same order. No "
                                  "update was applied and the window's gradients were dropped (on every rank). ",
                                  where, who, "\nSet comm.debug: true to stop at the differing call itself."));
}

}  // namespace

Decision decide_step(Communicator& comm, const RankReport& mine, int owner_ranks, int64_t window) {
  struct ClearLog {  // whatever happens, the next window starts empty
    CallLog& log;
    ~ClearLog() { log.clear(); }
  } clear{comm.calls()};
  const CallLog::Summary calls = comm.calls().summary();
  const int64_t row[kRow] = {mine.nonfinite, bits(mine.sum_squares), mine.missed_backward, calls.calls,
                             calls.fingerprint};
  std::vector<int64_t> rows;
  try {
    rows = gather_rows(comm, row, kRow);
  } catch (const CollectiveMismatchError& e) {  // comm.debug's check: the other ranks are elsewhere
    throw UsageError(__FILE__, __LINE__,
                     detail::concat("engine.step(): rank ", comm.rank(),
                                    " reached the end of the accumulation "
                                    "window while other ranks were still in a collective of backward (",
                                    mine.missed_backward, " of this rank's ", window,
                                    " micro-steps had no backward "
                                    "pass): call engine.backward(loss) before every engine.step() on every rank. ",
                                    e.message()));
  }
  const int world = comm.size();
  std::string missed;
  bool same_calls = true;
  for (int r = 0; r < world; ++r) {
    const int64_t* x = &rows[r * kRow];
    if (x[2] > 0) missed += detail::concat(missed.empty() ? "" : ", ", "rank ", r, " (", x[2], " of ", window, ")");
    same_calls = same_calls && x[3] == rows[3] && x[4] == rows[4];
  }
  if (!missed.empty()) {  // the likelier cause: a rank that skipped backward also called less
    throw UsageError(__FILE__, __LINE__,
                     detail::concat("engine.step(): a rank called step() without a backward pass since its "
                                    "previous step(): ",
                                    missed,
                                    " micro-steps of this accumulation window had "
                                    "none; no update was applied and the window's gradients were dropped (on "
                                    "every rank). Call engine.backward(loss) before every engine.step() on every "
                                    "rank; a rank without data can backpropagate a zero loss (for example loss * 0)"));
  }
  if (!same_calls) throw_first_difference(comm, rows, comm.calls().kept(), calls.calls);
  Decision d;
  const int summed = owner_ranks > 0 ? std::min(owner_ranks, world) : world;
  for (int r = 0; r < summed; ++r) {
    d.nonfinite += rows[r * kRow];
    d.sum_squares += from_bits(rows[r * kRow + 1]);
  }
  return d;
}

}  // namespace zerort
