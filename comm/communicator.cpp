#include "comm/communicator.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/local_reduce.h"
#include "comm/peer_exits.h"
#include "core/error.h"

namespace zerort {

struct Communicator::ScratchCounter {
  std::mutex mu;
  size_t live = 0, peak = 0;
};

size_t Communicator::scratch_peak_bytes() const {
  std::lock_guard<std::mutex> lock(scratch_->mu);
  return scratch_->peak;
}

void Communicator::reset_scratch_peak() {
  std::lock_guard<std::mutex> lock(scratch_->mu);
  scratch_->peak = scratch_->live;
}

std::shared_ptr<void> Communicator::track_scratch(size_t bytes) {
  auto counter = scratch_;  // outlives this communicator if the buffer is parked after a timeout
  {
    std::lock_guard<std::mutex> lock(counter->mu);
    counter->live += bytes;
    counter->peak = std::max(counter->peak, counter->live);
  }
  return std::shared_ptr<void>(nullptr, [counter, bytes](void*) {
    std::lock_guard<std::mutex> lock(counter->mu);
    counter->live -= bytes;
  });
}

std::shared_ptr<char[]> Communicator::allocate_scratch(size_t bytes) {
  auto token = track_scratch(bytes);
  return std::shared_ptr<char[]>(new char[bytes == 0 ? 1 : bytes], [token](char* p) { delete[] p; });
}

Communicator::Communicator(int rank, int size, CommOptions options)
    : rank_(rank), size_(size), options_(options), scratch_(std::make_shared<ScratchCounter>()),
      checked_(options.debug) {
  ZRT_CHECK(size >= 1, "world size must be at least 1, got ", size);
  ZRT_CHECK(rank >= 0 && rank < size, "rank ", rank, " is outside the world of size ", size);
  ZRT_CHECK_AS(ConfigError, options.timeout.count() > 0, "comm.timeout_s must be at least 1 ms, got ",
               options.timeout.count(), " ms");
}

void Communicator::delay_calls(DelayedCalls calls, std::chrono::microseconds delay) {
  const auto index = static_cast<size_t>(calls);
  ZRT_CHECK_AS(ConfigError, index < delay_us_.size(), "delay_calls: unknown kind of call ", static_cast<int32_t>(calls),
               "; use gathers or reduces");
  ZRT_CHECK_AS(ConfigError, delay.count() >= 0, "delay_calls: the delay must be >= 0 us, got ", delay.count());
  delay_us_[index].store(delay.count());
}

std::chrono::microseconds Communicator::call_delay(DelayedCalls calls) const {
  const auto index = static_cast<size_t>(calls);
  return std::chrono::microseconds(index < delay_us_.size() ? delay_us_[index].load() : 0);
}

namespace {

// The calls a delay of this kind belongs to, if any: See Note [delayed calls].
std::optional<DelayedCalls> delayed_calls(Collective kind) {
  switch (kind) {
    case Collective::kAllGather: return DelayedCalls::kGathers;
    case Collective::kAllReduce:
    case Collective::kReduceScatter:
    case Collective::kReduceScatterAccumulate: return DelayedCalls::kReduces;
    default: return std::nullopt;
  }
}

}  // namespace

CollectiveDesc Communicator::describe(Collective kind, size_t count, DType dtype, ReduceOp op, int root,
                                      int64_t tag) const {
  CollectiveDesc d;
  d.kind = kind;
  d.rank = rank_;
  d.world = size_;
  d.count = count;
  d.dtype = dtype;
  d.op = op;
  d.root = root;
  d.tag = tag;
  d.backend = backend_name();
  return d;
}

void Communicator::check(const CollectiveDesc& d, std::initializer_list<const void*> buffers) {
  const char* name = collective_name(d.kind);
  ZRT_CHECK(is_valid(d.dtype), name, " on rank ", rank_, ": unknown dtype value ", static_cast<int32_t>(d.dtype),
            "; use one of f32, f64, i32, i64, bf16, f16");
  ZRT_CHECK(is_valid(d.op), name, " on rank ", rank_, ": unknown reduce op value ", static_cast<int32_t>(d.op),
            "; use sum, max or min");
  if (d.kind == Collective::kReduceScatterAccumulate) {
    ZRT_CHECK(is_low_precision(d.dtype) || d.dtype == DType::kFloat32, name, " on rank ", rank_,
              ": input dtype must be bf16, f16 or f32 (the output is FP32), got ", dtype_name(d.dtype));
  }
  ZRT_CHECK(d.root >= 0 && d.root < size_, name, " on rank ", rank_, ": root ", d.root,
            " is outside the world of size ", size_);
  if (d.count > 0) {
    int index = 0;
    for (const void* p : buffers) {
      ZRT_CHECK(p != nullptr, d.to_string(), ": buffer argument ", index,
                " is null; pass a buffer holding the counted elements");
      ++index;
    }
  }
  calls_->record(d);
  if (const auto delayed = delayed_calls(d.kind)) {
    const std::chrono::microseconds delay = call_delay(*delayed);
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
  }
  if (checked_.load() && size_ > 1) check_consistent_across_ranks(d);
}

namespace {

constexpr size_t kProbeFields = std::tuple_size<CallFields>::value;

}  // namespace

void Communicator::check_consistent_across_ranks(const CollectiveDesc& d) {
  // Max over [x, -x] gives max and -min of every field in one all-reduce.
  const std::array<const char*, kProbeFields> names = {"collective", "dtype", "op", "count", "root", "tag"};
  const CallFields mine = call_fields(d);
  auto owned = std::make_shared<std::vector<int64_t>>(2 * kProbeFields);  // outlives a timeout
  std::vector<int64_t>& buf = *owned;
  for (size_t i = 0; i < kProbeFields; ++i) {
    buf[i] = mine[i];
    buf[kProbeFields + i] = -mine[i];
  }
  auto wait_probe = [&](const WorkPtr& work, const char* what) {
    try {
      work->wait(options_.timeout);
    } catch (const CommTimeoutError&) {
      const std::string gone = peer_exits(0);
      if (!gone.empty()) {  // the wait ended early: a peer exited (comm/peer_exits.h)
        throw CommTimeoutError(__FILE__, __LINE__,
                               peer_exit_message(detail::concat(d.to_string(), " (", what, ")"), gone));
      }
      throw CommTimeoutError(
          __FILE__, __LINE__,
          detail::concat(d.to_string(), ": ", what, " did not finish within ", options_.timeout.count(),
                         " ms; a peer rank is missing, stuck, or failed its own "
                         "argument check"));
    } catch (const Error& e) {  // the backend failed: typically a peer process exited or crashed
      throw CommError(__FILE__, __LINE__,
                      detail::concat(d.to_string(), ": ", what, " failed (", e.message(),
                                     "); a peer rank probably exited or crashed: see its log"));
    }
  };
  CollectiveDesc probe = describe(Collective::kAllReduce, buf.size(), DType::kInt64, ReduceOp::kMax);
  ++backend_calls_;
  auto work = do_all_reduce(buf.data(), probe);
  work->keep_alive(owned);
  wait_probe(work, "the argument check");
  // The first field that differs, the collective and the tag (what it serves) first.
  size_t first = kProbeFields;
  for (size_t i : {0, 5, 1, 2, 3, 4}) {
    if (first == kProbeFields && buf[i] != -buf[kProbeFields + i]) first = i;
  }
  if (first == kProbeFields) return;
  // Every rank saw the same max and min, so every rank is here: gather each rank's call so
  // the error says who called what.
  auto calls = std::make_shared<std::vector<int64_t>>(kProbeFields * static_cast<size_t>(size_));
  auto sent = std::make_shared<CallFields>(mine);
  ++backend_calls_;
  auto gather =
      do_all_gather(sent->data(), calls->data(), describe(Collective::kAllGather, kProbeFields, DType::kInt64));
  gather->keep_alive(calls);
  gather->keep_alive(sent);
  wait_probe(gather, "gathering every rank's call after a mismatch");
  std::string who;
  constexpr int kListed = 16;
  for (int r = 0; r < size_ && r < kListed; ++r) {
    CallFields f;
    std::copy_n(calls->data() + r * kProbeFields, kProbeFields, f.begin());
    who += detail::concat("\n  rank ", r, ": ", describe_call(f, r, size_));
  }
  if (size_ > kListed) who += detail::concat("\n  (", size_ - kListed, " more ranks)");
  if (first == 0) {
    throw CollectiveMismatchError(
        __FILE__, __LINE__,
        detail::concat(d.to_string(),
                       ": ranks called different collectives at the same point; every rank must "
                       "issue the same collectives in the same order. Each rank's call:",
                       who));
  }
  throw CollectiveMismatchError(
      __FILE__, __LINE__,
      detail::concat(d.to_string(), ": ", names[first], " differs across ranks; every rank must pass the same ",
                     names[first],
                     first == 5 ? " (the same bucket or unit: ranks took different paths through the model)" : "",
                     ". Each rank's call:", who));
}

WorkPtr Communicator::all_reduce(void* buf, size_t count, DType dtype, ReduceOp op, int64_t tag) {
  auto d = describe(Collective::kAllReduce, count, dtype, op, 0, tag);
  check(d, {buf});
  if (size_ == 1) return done(d);
  return issue([&] { return do_all_reduce(buf, d); });
}

WorkPtr Communicator::reduce_scatter(const void* in, void* out, size_t recv_count, DType dtype, ReduceOp op) {
  auto d = describe(Collective::kReduceScatter, recv_count, dtype, op);
  check(d, {in, out});
  if (size_ == 1) return local_copy(in, out, d);
  return issue([&] { return do_reduce_scatter(in, out, d); });
}

WorkPtr Communicator::reduce_scatter_accumulate(const void* in, DType in_dtype, float* out, size_t recv_count,
                                                bool accumulate, int64_t tag) {
  auto d = describe(Collective::kReduceScatterAccumulate, recv_count, in_dtype, ReduceOp::kSum, 0, tag);
  check(d, {in, out});
  if (size_ == 1) return local_reduce_scatter_accumulate(in, out, accumulate, d);
  return issue([&] { return do_reduce_scatter_accumulate(in, out, accumulate, d); });
}

WorkPtr Communicator::do_reduce_scatter_accumulate(const void* in, float* out, bool accumulate,
                                                   const CollectiveDesc& d) {
  // Scratch for the W received chunks; uninitialised (the all-to-all fills all of it).
  const size_t world = static_cast<size_t>(size_), n = d.count;
  const DType dtype = d.dtype;
  std::shared_ptr<char[]> chunks = allocate_scratch(n * world * dtype_size(dtype));
  WorkPtr work = do_all_to_all(in, chunks.get(), d);  // d names this call in errors
  work->keep_alive(chunks);
  work->then([chunks, dtype, world, n, out, accumulate] {
    sum_chunks_to_f32(chunks.get(), dtype, world, n, out, accumulate);
  });
  return work;
}

WorkPtr Communicator::done(const CollectiveDesc& d) const {
  return std::make_shared<CompletedWork>(d, options_.timeout);
}

WorkPtr Communicator::local_copy(const void* in, void* out, const CollectiveDesc& d) {
  if (in != out && d.count > 0) std::memcpy(out, in, d.count * dtype_size(d.dtype));
  return done(d);
}

WorkPtr Communicator::local_reduce_scatter_accumulate(const void* in, float* out, bool accumulate,
                                                      const CollectiveDesc& d) {
  sum_chunks_to_f32(in, d.dtype, 1, d.count, out, accumulate);
  return done(d);
}

WorkPtr Communicator::all_gather(const void* in, void* out, size_t send_count, DType dtype, int64_t tag) {
  auto d = describe(Collective::kAllGather, send_count, dtype, ReduceOp::kSum, 0, tag);
  check(d, {in, out});
  if (size_ == 1) return local_copy(in, out, d);
  return issue([&] { return do_all_gather(in, out, d); });
}

WorkPtr Communicator::all_to_all(const void* in, void* out, size_t count, DType dtype) {
  auto d = describe(Collective::kAllToAll, count, dtype);
  check(d, {in, out});
  if (size_ == 1) return local_copy(in, out, d);
  return issue([&] { return do_all_to_all(in, out, d); });
}

WorkPtr Communicator::broadcast(void* buf, size_t count, DType dtype, int root) {
  auto d = describe(Collective::kBroadcast, count, dtype, ReduceOp::kSum, root);
  check(d, {buf});
  if (size_ == 1) return done(d);
  return issue([&] { return do_broadcast(buf, d); });
}

WorkPtr Communicator::barrier() {
  auto d = describe(Collective::kBarrier, 0, DType::kFloat32);
  check(d, {});
  if (size_ == 1) return done(d);
  return issue([&] { return do_barrier(d); });
}

}  // namespace zerort
