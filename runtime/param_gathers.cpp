// ParamGathers: See Note [overlapped parameter gather] (param_gathers.h).
#include "runtime/param_gathers.h"

#include <exception>

namespace zerort {

void ParamGathers::start(size_t bucket, WorkPtr w, bool overlapped) {
  if (!overlapped) {
    WorkPtr oldest;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (in_flight_.size() >= kWindow) {
        oldest = std::move(in_flight_.front().second);
        in_flight_.pop_front();
      }
    }
    wait_in_stream_order(oldest);
  }
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_.emplace_back(bucket, std::move(w));
}

WorkPtr ParamGathers::take(size_t bucket) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = in_flight_.begin(); it != in_flight_.end(); ++it) {
    if (it->first == bucket) {
      WorkPtr w = std::move(it->second);
      in_flight_.erase(it);
      return w;
    }
  }
  return nullptr;
}

void ParamGathers::wait(size_t bucket) { wait_in_stream_order(take(bucket)); }

void ParamGathers::wait_all() {
  std::deque<std::pair<size_t, WorkPtr>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(in_flight_);
  }
  std::exception_ptr first;  // every Work is waited for (none left writing), then the first error
  for (auto& [bucket, w] : all) {
    try {
      wait_in_stream_order(w);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

std::vector<size_t> ParamGathers::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<size_t> out;
  for (const auto& [bucket, w] : in_flight_) out.push_back(bucket);
  return out;
}

}  // namespace zerort
