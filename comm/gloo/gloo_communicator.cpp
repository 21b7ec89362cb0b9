#include "comm/gloo/gloo_communicator.h"

#include <ATen/ops/from_blob.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <algorithm>
#include <thread>

#include "comm/peer_exits.h"
#include "core/error.h"

namespace zerort {

namespace {

at::ScalarType scalar_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat64: return at::kDouble;
    case DType::kInt32: return at::kInt;
    case DType::kInt64: return at::kLong;
    case DType::kBFloat16: return at::kBFloat16;
    case DType::kFloat16: return at::kHalf;
  }
  ZRT_THROW("gloo: unknown dtype value ", static_cast<int32_t>(dtype));
}

c10d::ReduceOp c10d_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return c10d::ReduceOp::SUM;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
  }
  ZRT_THROW("gloo: unknown reduce op value ", static_cast<int32_t>(op));
}

// A CPU tensor over caller memory; c10d never frees it.
at::Tensor view(const void* data, size_t count, DType dtype) {
  return at::from_blob(const_cast<void*>(data), {static_cast<int64_t>(count)},
                       at::TensorOptions().dtype(scalar_type(dtype)));
}

// gloo fails a collective at once when a peer's process ends ("Connection closed by peer").
// A peer that ended normally left an exit notice (zerort.comm.peers), which the watcher
// notes within its poll: wait that long for it, to say so instead of "crashed".
std::string exited_peer(const std::string& what) {
  if (what.find("Connection closed by peer") == std::string::npos) return "";
  for (int i = 0; i < 30; ++i) {
    std::string gone = peer_exits(0);
    if (!gone.empty()) return gone;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return "";
}

class GlooWork final : public Work {
 public:
  GlooWork(const CollectiveDesc& d, std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Work> work)
      : Work(d, timeout), work_(std::move(work)) {}
  ~GlooWork() override {
    if (!work_->isCompleted()) retire_buffers();  // gloo may still write into them
  }

 protected:
  // c10d's Work::wait(timeout) throws "Operation timed out!" at the deadline for
  // all_reduce, all_gather, all_to_all, broadcast and barrier. Its reduce_scatter work
  // ignores that timeout (seen in torch 2.13) and is bounded by the process group's own
  // timeout instead, which zerort.comm.init sets to the same comm.timeout_s. Either way
  // a timeout becomes our CommTimeoutError naming the collective.
  bool wait_until(std::chrono::steady_clock::time_point deadline) override {
    auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      work_->wait(std::max(remaining, std::chrono::milliseconds(1)));
    } catch (const std::exception& e) {
      std::string what = e.what();
      if (what.find("timed out") != std::string::npos || what.find("Timed out") != std::string::npos) {
        return false;
      }
      const std::string gone = exited_peer(what);
      if (!gone.empty()) ZRT_THROW_AS(CommError, peer_exit_message(desc().to_string(), gone), " (gloo: ", what, ")");
      ZRT_THROW_AS(CommError, desc().to_string(), " failed in c10d gloo: ", what);
    }
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::Backend> backend, CommOptions options)
      : Communicator(backend->getRank(), backend->getSize(), options), backend_(std::move(backend)) {}
  const char* backend_name() const override { return "gloo"; }

 protected:
  WorkPtr do_all_reduce(void* buf, const CollectiveDesc& d) override {
    std::vector<at::Tensor> tensors{view(buf, d.count, d.dtype)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d_op(d.op);
    return run(d, [&] { return backend_->allreduce(tensors, opts); });
  }
  WorkPtr do_reduce_scatter(const void* in, void* out, const CollectiveDesc& d) override {
    at::Tensor input = view(in, d.count * static_cast<size_t>(size()), d.dtype);
    at::Tensor output = view(out, d.count, d.dtype);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d_op(d.op);
    return run(d, [&] { return backend_->_reduce_scatter_base(output, input, opts); });
  }
  WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) override {
    at::Tensor input = view(in, d.count, d.dtype);
    at::Tensor output = view(out, d.count * static_cast<size_t>(size()), d.dtype);
    const char* own = static_cast<const char*>(out) + static_cast<size_t>(rank()) * d.count * dtype_size(d.dtype);
    if (in == own) input = input.clone();  // in-place call: gloo gets a separate input
    return run(d, [&] { return backend_->_allgather_base(output, input); });
  }
  WorkPtr do_all_to_all(const void* in, void* out, const CollectiveDesc& d) override {
    size_t total = d.count * static_cast<size_t>(size());
    at::Tensor input = view(in, total, d.dtype);
    at::Tensor output = view(out, total, d.dtype);
    std::vector<int64_t> equal_splits;  // empty: W equal chunks
    return run(d, [&] { return backend_->alltoall_base(output, input, equal_splits, equal_splits); });
  }
  WorkPtr do_broadcast(void* buf, const CollectiveDesc& d) override {
    std::vector<at::Tensor> tensors{view(buf, d.count, d.dtype)};
    c10d::BroadcastOptions opts;
    opts.rootRank = d.root;
    return run(d, [&] { return backend_->broadcast(tensors, opts); });
  }
  WorkPtr do_barrier(const CollectiveDesc& d) override {
    return run(d, [&] { return backend_->barrier(); });
  }

 private:
  template <typename Launch>
  WorkPtr run(const CollectiveDesc& d, Launch&& launch) {
    if (d.count == 0 && d.kind != Collective::kBarrier) {
      return std::make_shared<CompletedWork>(d, options().timeout);  // gloo rejects empty tensors
    }
    try {
      return std::make_shared<GlooWork>(d, options().timeout, launch());
    } catch (const std::exception& e) {
      ZRT_THROW_AS(CommError, d.to_string(), " was rejected by c10d gloo: ", e.what());
    }
  }

  c10::intrusive_ptr<c10d::Backend> backend_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(const std::string& group_name, CommOptions options) {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(group_name);
  } catch (const std::exception& e) {
    ZRT_THROW_AS(CommError, "gloo: no torch.distributed process group named '", group_name,
                 "'; call torch.distributed.init_process_group('gloo') first (", e.what(), ")");
  }
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = group->getBackend(c10::DeviceType::CPU);
  } catch (const std::exception& e) {
    ZRT_THROW_AS(CommError, "gloo: process group '", group_name, "' has no backend for CPU tensors (", e.what(),
                 "); initialise it with backend='gloo'");
  }
  ZRT_CHECK_AS(CommError, backend->getBackendName() == "gloo", "gloo: process group '", group_name, "' uses backend '",
               backend->getBackendName(), "' for CPU tensors, not gloo");
  return std::make_unique<GlooCommunicator>(std::move(backend), options);
}

}  // namespace zerort
