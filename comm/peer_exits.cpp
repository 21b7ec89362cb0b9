#include "comm/peer_exits.h"

#include <chrono>
#include <map>
#include <mutex>

#include "core/error.h"

namespace zerort {

namespace {

struct Exit {
  std::string how;
  std::chrono::steady_clock::time_point noted;
};

std::mutex mu;
std::map<int, Exit>& exits() {
  static auto* m = new std::map<int, Exit>();  // never freed: read by waits during exit
  return *m;
}

}  // namespace

void note_peer_exit(int rank, const std::string& how) {
  std::lock_guard<std::mutex> lock(mu);
  exits().emplace(rank, Exit{how, std::chrono::steady_clock::now()});  // the first notice stays
}

std::string peer_exits(long settled_ms) {
  std::lock_guard<std::mutex> lock(mu);
  const auto now = std::chrono::steady_clock::now();
  std::string out;
  for (const auto& [rank, e] : exits()) {
    if (now - e.noted < std::chrono::milliseconds(settled_ms)) continue;
    out += detail::concat(out.empty() ? "" : ", ", "rank ", rank, " ", e.how);
  }
  return out;
}

std::string peer_exit_message(const std::string& call, const std::string& gone) {
  return detail::concat(call, " cannot finish: ", gone,
                        " while this rank waited for it. Every rank must make the "
                        "same collectives before it exits: a rank that stops early (fewer steps or batches, an early "
                        "return) leaves the others waiting");
}

void clear_peer_exits() {
  std::lock_guard<std::mutex> lock(mu);
  exits().clear();
}

}  // namespace zerort
