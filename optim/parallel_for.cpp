#include "optim/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <thread>
#include <vector>

namespace zerort {

int cpu_threads() {
  static const int threads = [] {
    if (const char* env = std::getenv("ZERORT_NUM_THREADS")) {
      int v = std::atoi(env);
      if (v > 0) return v;
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return threads;
}

void parallel_for(size_t n, size_t block, const std::function<void(size_t, size_t, size_t)>& fn) {
  if (n == 0) return;
  block = std::max<size_t>(block, 1);
  const size_t blocks = (n + block - 1) / block;
  const size_t workers = std::min<size_t>(static_cast<size_t>(cpu_threads()), blocks);
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto work = [&] {
    for (size_t b; (b = next.fetch_add(1)) < blocks;) {
      try {
        fn(b, b * block, std::min(n, (b + 1) * block));
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
      }
    }
  };
  // Every thread started is joined before this returns: `work` never throws, and the
  // vector never reallocates once a thread runs (a failed reallocation would destroy
  // joinable threads, which ends the process).
  std::vector<std::thread> threads;
  try {
    threads.reserve(workers - 1);
  } catch (...) {  // no memory for the handles: the caller's thread does every block
  }
  for (size_t t = 1; t < workers && threads.size() < threads.capacity(); ++t) {
    try {
      threads.emplace_back(work);
    } catch (...) {
      break;  // out of threads: the caller's thread and those started do all the blocks
    }
  }
  work();
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace zerort
