#include "comm/communicator.h"

#include <algorithm>
#include <array>
#include <mutex>
#include <cstdint>
#include <vector>

#include "comm/error.h"
#include "comm/local_reduce.h"

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
    : rank_(rank), size_(size), options_(options), scratch_(std::make_shared<ScratchCounter>()) {
  ZRT_CHECK(size >= 1, "world size must be at least 1, got ", size);
  ZRT_CHECK(rank >= 0 && rank < size, "rank ", rank, " is outside the world of size ", size);
  ZRT_CHECK(options.timeout.count() > 0, "comm.timeout_s must be at least 1 ms, got ",
            options.timeout.count(), " ms");
}

CollectiveDesc Communicator::describe(Collective kind, size_t count, DType dtype, ReduceOp op,
                                      int root) const {
  CollectiveDesc d;
  d.kind = kind;
  d.rank = rank_;
  d.world = size_;
  d.count = count;
  d.dtype = dtype;
  d.op = op;
  d.root = root;
  d.backend = backend_name();
  return d;
}

void Communicator::check(const CollectiveDesc& d, std::initializer_list<const void*> buffers) {
  const char* name = collective_name(d.kind);
  ZRT_CHECK(is_valid(d.dtype), name, " on rank ", rank_, ": unknown dtype value ",
            static_cast<int32_t>(d.dtype), "; use one of f32, f64, i32, i64, bf16, f16");
  ZRT_CHECK(is_valid(d.op), name, " on rank ", rank_, ": unknown reduce op value ",
            static_cast<int32_t>(d.op), "; use sum, max or min");
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
  if (options_.check_consistency && size_ > 1) check_consistent_across_ranks(d);
}

void Communicator::check_consistent_across_ranks(const CollectiveDesc& d) {
  // Max over [x, -x] gives max and -min of every field in one all-reduce.
  constexpr size_t kFields = 5;
  const std::array<const char*, kFields> names = {"collective", "dtype", "op", "count", "root"};
  std::array<int64_t, kFields> mine = {static_cast<int64_t>(d.kind), static_cast<int64_t>(d.dtype),
                                       static_cast<int64_t>(d.op), static_cast<int64_t>(d.count),
                                       static_cast<int64_t>(d.root)};
  auto owned = std::make_shared<std::vector<int64_t>>(2 * kFields);  // outlives a timeout
  std::vector<int64_t>& buf = *owned;
  for (size_t i = 0; i < kFields; ++i) {
    buf[i] = mine[i];
    buf[kFields + i] = -mine[i];
  }
  CollectiveDesc probe = describe(Collective::kAllReduce, buf.size(), DType::kInt64, ReduceOp::kMax);
  auto work = do_all_reduce(buf.data(), probe);
  work->keep_alive(owned);
  try {
    work->wait(options_.timeout);
  } catch (const TimeoutError&) {
    throw TimeoutError(__FILE__, __LINE__,
                       detail::concat(d.to_string(), ": the argument check did not finish within ",
                                      options_.timeout.count(),
                                      " ms; a peer rank is missing, stuck, or failed its own "
                                      "argument check"));
  } catch (const Error& e) {  // the backend failed: typically a peer process exited or crashed
    throw Error(__FILE__, __LINE__,
                detail::concat(d.to_string(), ": the argument check failed (", e.message(),
                               "); a peer rank probably exited or crashed: see its log"));
  }
  for (size_t i = 0; i < kFields; ++i) {
    int64_t hi = buf[i], lo = -buf[kFields + i];
    if (hi == lo) continue;
    if (i == 0) {
      ZRT_THROW(d.to_string(), ": ranks called different collectives at the same point (codes ", lo,
                "..", hi, "); every rank must issue the same collectives in the same order");
    }
    ZRT_THROW(d.to_string(), ": ", names[i], " differs across ranks: this rank passed ", mine[i],
              ", the ranks passed values from ", lo, " to ", hi, "; every rank must pass the same ",
              names[i]);
  }
}

WorkPtr Communicator::all_reduce(void* buf, size_t count, DType dtype, ReduceOp op) {
  auto d = describe(Collective::kAllReduce, count, dtype, op);
  check(d, {buf});
  return do_all_reduce(buf, d);
}

WorkPtr Communicator::reduce_scatter(const void* in, void* out, size_t recv_count, DType dtype,
                                     ReduceOp op) {
  auto d = describe(Collective::kReduceScatter, recv_count, dtype, op);
  check(d, {in, out});
  return do_reduce_scatter(in, out, d);
}

WorkPtr Communicator::reduce_scatter_accumulate(const void* in, DType in_dtype, float* out,
                                                size_t recv_count, bool accumulate) {
  auto d = describe(Collective::kReduceScatterAccumulate, recv_count, in_dtype);
  check(d, {in, out});
  return do_reduce_scatter_accumulate(in, out, accumulate, d);
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

WorkPtr Communicator::all_gather(const void* in, void* out, size_t send_count, DType dtype) {
  auto d = describe(Collective::kAllGather, send_count, dtype);
  check(d, {in, out});
  return do_all_gather(in, out, d);
}

WorkPtr Communicator::all_to_all(const void* in, void* out, size_t count, DType dtype) {
  auto d = describe(Collective::kAllToAll, count, dtype);
  check(d, {in, out});
  return do_all_to_all(in, out, d);
}

WorkPtr Communicator::broadcast(void* buf, size_t count, DType dtype, int root) {
  auto d = describe(Collective::kBroadcast, count, dtype, ReduceOp::kSum, root);
  check(d, {buf});
  return do_broadcast(buf, d);
}

WorkPtr Communicator::barrier() {
  auto d = describe(Collective::kBarrier, 0, DType::kFloat32);
  check(d, {});
  return do_barrier(d);
}

}  // namespace zerort
