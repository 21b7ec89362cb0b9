// Runs fn(comm) on W threads over one InProcessGroup and returns what each rank threw
// ("" for a rank that returned normally). The in-process multi-rank test harness.
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/inprocess_communicator.h"

namespace zerort::testing {

inline std::vector<std::string> run_ranks(int world, const std::function<void(Communicator&)>& fn,
                                          CommOptions options = {}) {
  auto group = InProcessGroup::create(world, options);
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto comm = group->communicator(r);
        fn(*comm);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        if (errors[static_cast<size_t>(r)].empty()) errors[static_cast<size_t>(r)] = "(empty what())";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace zerort::testing
