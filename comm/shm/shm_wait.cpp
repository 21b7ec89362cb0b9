// ShmSegment's cross-process wait (Note [shm rounds]): a short spin, a few yields, then
// FUTEX_WAIT on the shared futex word in slices of at most 50 ms; between slices the
// deadline, the abort word and the peers' pids are checked.
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <thread>

#include "comm/peer_exits.h"
#include "comm/shm/shm_layout.h"
#include "comm/shm/shm_segment.h"
#include "core/error.h"

namespace zerort {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kSlice = std::chrono::milliseconds(50);
constexpr int kSpins = 200;       // checks before yielding: an oversubscribed host must not burn its cores
constexpr int kYields = 8;        // then sched_yield between checks, then the futex
constexpr int kNoticeTries = 30;  // 30 x 50 ms for an exited peer's exit notice (comm/peer_exits.h)

uint32_t* futex_word(std::atomic<uint32_t>& a) { return reinterpret_cast<uint32_t*>(&a); }

void futex_wait(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::nanoseconds for_at_most) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(for_at_most.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(for_at_most.count() % 1000000000);
  // Shared (not FUTEX_PRIVATE): the word lives in a mapping that other processes share.
  syscall(SYS_futex, futex_word(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, futex_word(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool reached(uint32_t arrived, uint32_t round) { return static_cast<int32_t>(arrived - round) >= 0; }

// Gone: no such process, or a zombie that its parent has not reaped yet.
bool process_gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

}  // namespace

void ShmSegment::arrive(uint32_t round) {
  slot(rank_).arrived.store(round);
  Header& h = header();
  h.futex.fetch_add(1);
  if (h.sleepers.load() > 0) futex_wake_all(h.futex);
}

bool ShmSegment::all_arrived(uint32_t round) const {
  for (int r = 0; r < world_; ++r) {
    if (!reached(slot(r).arrived.load(), round)) return false;
  }
  return true;
}

std::string ShmSegment::who(int r) const {
  const Slot& s = slot(r);
  const int32_t launch = s.launch_rank.load();
  if (launch >= 0 && launch != r)
    return detail::concat("rank ", r, " (launch rank ", launch, ", pid ", s.pid.load(), ")");
  return detail::concat("rank ", r, " (pid ", s.pid.load(), ")");
}

std::string ShmSegment::missing(uint32_t round) const {
  std::string out;
  for (int r = 0; r < world_; ++r) {
    if (!reached(slot(r).arrived.load(), round)) out += detail::concat(out.empty() ? "" : ", ", who(r));
  }
  return out;
}

void ShmSegment::throw_if_aborted(const std::string& call) const {
  const Header& h = header();
  const int32_t by = h.aborted_by.load();
  if (by > 0) {
    ZRT_THROW_AS(CommError, call, " cannot finish: ", who(by - 1), " gave up on the shared-memory group: ",
                 std::string(h.abort_reason, strnlen(h.abort_reason, kShmReasonBytes)), "; see that rank's log");
  }
}

void ShmSegment::check_peers(uint32_t round, const std::string& call) const {
  for (int r = 0; r < world_; ++r) {
    if (!watch_pid_[static_cast<size_t>(r)] || reached(slot(r).arrived.load(), round)) continue;
    if (!process_gone(slot(r).pid.load())) continue;
    // A peer that ended normally left an exit notice (zerort.comm.peers): wait for it, as gloo does.
    for (int i = 0; i < kNoticeTries; ++i) {
      const std::string gone = peer_exits(0);
      if (!gone.empty()) ZRT_THROW_AS(CommError, peer_exit_message(call, gone), " (shm: ", who(r), " is gone)");
      std::this_thread::sleep_for(kSlice);
    }
    ZRT_THROW_AS(CommError, who(r), " exited during ", call,
                 " (killed or crashed, with no exit notice): see that rank's log; the job cannot go on without it");
  }
}

void ShmSegment::sleep_slice(uint32_t seen, Clock::time_point until) {
  Header& h = header();
  const auto left = std::max(until - Clock::now(), Clock::duration(std::chrono::microseconds(100)));
  h.sleepers.fetch_add(1);
  futex_wait(h.futex, seen, std::min<Clock::duration>(left, kSlice));
  h.sleepers.fetch_sub(1);
}

void ShmSegment::wait_all(uint32_t round, Clock::time_point deadline, const std::string& call,
                          std::chrono::milliseconds timeout) {
  // An aborted group fails every later round, even one whose arrivals look complete: the
  // rank that gave up may have arrived at it for the call it abandoned.
  throw_if_aborted(call);
  for (int i = 0; i < kSpins + kYields; ++i) {
    if (all_arrived(round)) return;
    if (i >= kSpins) sched_yield();
  }
  for (;;) {
    // Read the futex word before the check, so an arrival after the check changes it and
    // FUTEX_WAIT returns at once rather than missing the wake.
    const uint32_t seen = header().futex.load();
    if (all_arrived(round)) return;
    ZRT_CHECK_AS(CommError, !closing_.load(), call, ": the shm communicator is closing");
    throw_if_aborted(call);
    check_peers(round, call);
    const auto now = Clock::now();
    if (now >= deadline) {
      ZRT_THROW_AS(CommTimeoutError, call, " did not finish within ", timeout.count(), " ms: ", missing(round),
                   " did not arrive. A peer rank is missing, stuck, failed its own argument check, or called a ",
                   "different collective (comm.debug: true checks every call across ranks and names each rank's); ",
                   "raise comm.timeout_s if the peers are just slow");
    }
    sleep_slice(seen, deadline);
  }
}

void ShmSegment::abort(const std::string& why) {
  Header& h = header();
  int32_t none = 0;
  if (h.abort_claim.compare_exchange_strong(none, rank_ + 1)) {
    const size_t n = std::min(why.size(), kShmReasonBytes - 1);
    std::memcpy(h.abort_reason, why.data(), n);
    h.abort_reason[n] = '\0';
    h.aborted_by.store(rank_ + 1);
  }
  h.futex.fetch_add(1);
  futex_wake_all(h.futex);
}

}  // namespace zerort
