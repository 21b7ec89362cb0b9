#include "comm/nccl/nccl_communicator.h"

#include <nccl.h>

#include <cstring>
#include <functional>
#include <vector>

#include "comm/cuda_streams.h"
#include "comm/launch_env.h"
#include "comm/local_reduce_cuda.h"
#include "comm/nccl/nccl_split.h"
#include "comm/nccl/nccl_work.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "zerort/config.h"
#if ZERORT_WITH_MPI
#include "comm/mpi_communicator.h"
#endif

namespace zerort {

namespace {

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
  }
  ZRT_THROW("NCCL: unsupported dtype ", dtype_name(d));
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kMax ? ncclMax : op == ReduceOp::kMin ? ncclMin : ncclSum; }

// Memory of `device` (device or managed); false for host memory and for other GPUs.
bool is_device_pointer(const void* p, int device) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // clear the error of an unknown pointer
    return false;
  }
  return (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) && attr.device == device;
}

// ncclGroupStart now; ncclGroupEnd on end() or, if an enqueue throws half way, on scope
// exit, so this thread is never left inside a group.
class NcclGroup {
 public:
  explicit NcclGroup(ncclComm_t comm) : comm_(comm) { ZRT_CHECK_NCCL(ncclGroupStart(), comm_); }
  void end() {
    ended_ = true;
    ZRT_CHECK_NCCL(ncclGroupEnd(), comm_);
  }
  ~NcclGroup() {
    if (!ended_) ncclGroupEnd();
  }

 private:
  ncclComm_t comm_;
  bool ended_ = false;
};

// One collective in three phases. NCCL may still be launching after its calls return (a
// nonblocking communicator), and nothing else may go on its stream until it has settled,
// so CUDA work that uses the result waits for `after`.
struct Phases {
  std::function<void(cudaStream_t)> before;            // CUDA work the collective reads
  std::function<void(ncclComm_t, cudaStream_t)> nccl;  // NCCL calls only (none at W = 1)
  std::function<void(cudaStream_t)> after;             // CUDA work on the collective's result
};

std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds t) {
  return std::chrono::steady_clock::now() + t;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, const std::string& id, CommOptions options)
      : Communicator(rank, size, options), state_(std::make_shared<NcclState>()) {
    ZRT_CHECK(id.size() == sizeof(ncclUniqueId), "NCCL: the unique id must be ", sizeof(ncclUniqueId),
              " bytes (from nccl_unique_id() on rank 0), got ", id.size());
    int count = 0;
    ZRT_CHECK_CUDA(cudaGetDeviceCount(&count));
    ZRT_CHECK(device >= 0 && device < count, "NCCL: rank ", rank, " asked for CUDA device ", device, " but ", count,
              " are visible; set CUDA_VISIBLE_DEVICES or pass a device in [0, ", count, ")");
    state_->device = device;
    CudaDeviceGuard guard(device);
    int lo = 0, hi = 0;
    ZRT_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    ZRT_CHECK_CUDA(cudaStreamCreateWithPriority(&state_->stream, cudaStreamNonBlocking, hi));
    ncclUniqueId uid;
    std::memcpy(&uid, id.data(), sizeof(uid));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns; settle() bounds the wait by the timeout
    ZRT_CHECK_NCCL(ncclCommInitRankConfig(&state_->comm, size, uid, rank, &config), nullptr);
    if (!state_->settle(deadline_after(options.timeout), "ncclCommInitRankConfig")) {
      // NCCL's own thread is still waiting for the missing peer. ncclCommAbort on a
      // communicator in that state crashed the process (SIGSEGV, H200, scripts/gpu_check.sh),
      // so the half-made communicator and its stream are left to the process's exit.
      state_->comm = nullptr;
      state_->stream = nullptr;
      ZRT_THROW_AS(CommTimeoutError, "NCCL: rank ", rank, " of ", size, " could not create the communicator within ",
                   options.timeout.count(), " ms; a peer rank is missing or got a different unique id");
    }
  }

  ~NcclCommunicator() override { state_->watchdog.stop(); }  // Note [stream-waited work]

  const char* backend_name() const override { return "nccl"; }
  bool device_memory() const override { return true; }
  NcclState& state() { return *state_; }

 protected:
  WorkPtr do_all_reduce(void* buf, const CollectiveDesc& d) override {
    if (!is_device_pointer(buf, state_->device)) return staged(buf, d, true);
    return enqueue(d, {nullptr,
                       [&](ncclComm_t c, cudaStream_t s) {
                         ZRT_CHECK_NCCL(ncclAllReduce(buf, buf, d.count, nccl_type(d.dtype), nccl_op(d.op), c, s), c);
                       },
                       nullptr});
  }
  WorkPtr do_broadcast(void* buf, const CollectiveDesc& d) override {
    if (!is_device_pointer(buf, state_->device)) return staged(buf, d, false);
    return enqueue(d, {nullptr,
                       [&](ncclComm_t c, cudaStream_t s) {
                         ZRT_CHECK_NCCL(ncclBroadcast(buf, buf, d.count, nccl_type(d.dtype), d.root, c, s), c);
                       },
                       nullptr});
  }
  WorkPtr do_reduce_scatter(const void* in, void* out, const CollectiveDesc& d) override {
    require_device(d, {in, out});
    return enqueue(d, {nullptr,
                       [&](ncclComm_t c, cudaStream_t s) {
                         ZRT_CHECK_NCCL(ncclReduceScatter(in, out, d.count, nccl_type(d.dtype), nccl_op(d.op), c, s),
                                        c);
                       },
                       nullptr});
  }
  WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) override {
    require_device(d, {in, out});
    return enqueue(d, {nullptr,
                       [&](ncclComm_t c, cudaStream_t s) {
                         ZRT_CHECK_NCCL(ncclAllGather(in, out, d.count, nccl_type(d.dtype), c, s), c);
                       },
                       nullptr});
  }
  WorkPtr do_all_to_all(const void* in, void* out, const CollectiveDesc& d) override {
    require_device(d, {in, out});
    return enqueue(d, {nullptr, [&](ncclComm_t c, cudaStream_t s) { all_to_all(in, out, d, c, s); }, nullptr});
  }
  WorkPtr do_barrier(const CollectiveDesc& d) override {
    auto one = std::make_shared<int32_t>(1);
    CollectiveDesc probe = d;
    probe.count = 1;
    probe.dtype = DType::kInt32;
    WorkPtr w = staged(one.get(), probe, true);
    w->keep_alive(one);
    return w;
  }
  // W = 1: a copy or the FP64 sum kernel on the communicator's stream, no NCCL call.
  WorkPtr local_copy(const void* in, void* out, const CollectiveDesc& d) override {
    require_device(d, {in, out});  // as at W > 1
    if (in == out || d.count == 0) return std::make_shared<CompletedWork>(d, options().timeout);
    return enqueue(d, {[&](cudaStream_t s) {
                         ZRT_CHECK_CUDA(cudaMemcpyAsync(out, in, d.count * dtype_size(d.dtype), cudaMemcpyDefault, s));
                       },
                       nullptr, nullptr});
  }
  WorkPtr local_reduce_scatter_accumulate(const void* in, float* out, bool accumulate,
                                          const CollectiveDesc& d) override {
    require_device(d, {in, out});
    if (d.count == 0) return std::make_shared<CompletedWork>(d, options().timeout);
    return enqueue(d, {[&](cudaStream_t s) { sum_chunks_to_f32_cuda(in, d.dtype, 1, d.count, out, accumulate, s); },
                       nullptr, nullptr});
  }
  // All on the device: grouped send/recv into device scratch, then (once NCCL has
  // settled) the FP64 local sum kernel on the same stream; the scratch is freed
  // stream-ordered behind the kernel.
  WorkPtr do_reduce_scatter_accumulate(const void* in, float* out, bool accumulate, const CollectiveDesc& d) override {
    require_device(d, {in, out});
    if (d.count == 0) return std::make_shared<CompletedWork>(d, options().timeout);
    const size_t world = static_cast<size_t>(size()), bytes = world * d.count * dtype_size(d.dtype);
    auto token = track_scratch(bytes);
    void* chunks = nullptr;
    WorkPtr w = enqueue(d, {[&](cudaStream_t s) { ZRT_CHECK_CUDA(cudaMallocAsync(&chunks, bytes, s)); },
                            [&](ncclComm_t c, cudaStream_t s) { all_to_all(in, chunks, d, c, s); },
                            [&](cudaStream_t s) {
                              sum_chunks_to_f32_cuda(chunks, d.dtype, world, d.count, out, accumulate, s);
                              ZRT_CHECK_CUDA(cudaFreeAsync(chunks, s));
                            }});
    w->keep_alive(token);
    return w;
  }

 private:
  // The one path to the device: order after the compute stream, the CUDA work before, the
  // NCCL calls, settle the nonblocking communicator, the CUDA work after, the completion
  // event.
  WorkPtr enqueue(const CollectiveDesc& d, const Phases& phases) {
    NcclState& st = *state_;
    std::lock_guard<std::mutex> lock(st.mu);
    st.check_usable();
    CudaDeviceGuard guard(st.device);
    cuda_stream_order(st.device).side_after_compute(st.stream);  // Note [stream order]
    if (phases.before) phases.before(st.stream);
    if (phases.nccl) {
      std::lock_guard<std::mutex> calls(st.call_mu);
      st.check_usable();
      phases.nccl(st.comm, st.stream);
    }
    if (phases.nccl && !st.settle(deadline_after(options().timeout), collective_name(d.kind))) {
      st.abort(detail::concat(d.to_string(), " could not be enqueued"));
      throw CommTimeoutError(__FILE__, __LINE__,
                             detail::concat(d.to_string(), ": NCCL did not accept the collective within ",
                                            options().timeout.count(), " ms; a peer rank is missing or stuck"));
    }
    if (phases.after) phases.after(st.stream);
    cudaEvent_t done = nullptr;
    ZRT_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    ZRT_CHECK_CUDA(cudaEventRecord(done, st.stream));
    return std::make_shared<NcclWork>(d, options().timeout, state_, done);
  }

  void all_to_all(const void* in, void* out, const CollectiveDesc& d, ncclComm_t c, cudaStream_t s) {
    const size_t bytes = d.count * dtype_size(d.dtype);
    NcclGroup group(c);
    for (int r = 0; r < size(); ++r) {
      ZRT_CHECK_NCCL(ncclSend(static_cast<const char*>(in) + r * bytes, d.count, nccl_type(d.dtype), r, c, s), c);
      ZRT_CHECK_NCCL(ncclRecv(static_cast<char*>(out) + r * bytes, d.count, nccl_type(d.dtype), r, c, s), c);
    }
    group.end();
  }

  // A small host buffer through pinned memory and a device copy. The result reaches `buf`
  // on the waiting thread (Work::then), never by a blocking copy that could outlive the
  // timeout.
  WorkPtr staged(void* buf, const CollectiveDesc& d, bool reduce) {
    if (d.count == 0) return std::make_shared<CompletedWork>(d, options().timeout);
    const size_t bytes = d.count * dtype_size(d.dtype);
    std::shared_ptr<void> pinned = state_->pinned(bytes, state_);
    std::memcpy(pinned.get(), buf, bytes);
    void* dev = nullptr;
    WorkPtr w = enqueue(d, {[&](cudaStream_t s) {
                              ZRT_CHECK_CUDA(cudaMallocAsync(&dev, bytes, s));
                              ZRT_CHECK_CUDA(cudaMemcpyAsync(dev, pinned.get(), bytes, cudaMemcpyHostToDevice, s));
                            },
                            [&](ncclComm_t c, cudaStream_t s) {
                              const ncclDataType_t type = nccl_type(d.dtype);
                              if (reduce) {
                                ZRT_CHECK_NCCL(ncclAllReduce(dev, dev, d.count, type, nccl_op(d.op), c, s), c);
                              } else {
                                ZRT_CHECK_NCCL(ncclBroadcast(dev, dev, d.count, type, d.root, c, s), c);
                              }
                            },
                            [&](cudaStream_t s) {
                              ZRT_CHECK_CUDA(cudaMemcpyAsync(pinned.get(), dev, bytes, cudaMemcpyDeviceToHost, s));
                              ZRT_CHECK_CUDA(cudaFreeAsync(dev, s));
                            }});
    w->keep_alive(pinned);
    w->then([buf, pinned, bytes] { std::memcpy(buf, pinned.get(), bytes); });
    return w;
  }

  void require_device(const CollectiveDesc& d, std::initializer_list<const void*> buffers) {
    if (d.count == 0) return;
    int index = 0;
    for (const void* p : buffers) {
      ZRT_CHECK_AS(DeviceError, is_device_pointer(p, state_->device), d.to_string(), ": buffer argument ", index,
                   " is not memory of this communicator's GPU; the nccl backend moves device buffers (put the "
                   "tensor on cuda:",
                   state_->device, ", or use the mpi or gloo backend for CPU tensors)");
      ++index;
    }
  }

  std::shared_ptr<NcclState> state_;

 public:
  // A part of this communicator (Note [nccl parts]): a communicator of its own, with its stream.
  std::unique_ptr<Communicator> split(int color, int key, const std::string& group, CommOptions options) {
    NcclSplit part = split_nccl_state(*state_, rank(), size(), color, key, group, options.timeout);
    return std::unique_ptr<Communicator>(new NcclCommunicator(part, options));
  }

 private:
  NcclCommunicator(NcclSplit& part, CommOptions options)
      : Communicator(part.rank, part.size, options), state_(std::move(part.state)) {
    CudaDeviceGuard guard(state_->device);
    int lo = 0, hi = 0;
    ZRT_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    ZRT_CHECK_CUDA(cudaStreamCreateWithPriority(&state_->stream, cudaStreamNonBlocking, hi));
  }
};

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  ZRT_CHECK_NCCL(ncclGetUniqueId(&id), nullptr);
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

std::unique_ptr<Communicator> make_nccl_communicator(int rank, int size, int device, const std::string& unique_id,
                                                     CommOptions options) {
  return std::make_unique<NcclCommunicator>(rank, size, device, unique_id, options);
}

std::unique_ptr<Communicator> make_nccl_part(Communicator& parent, int color, int key, const std::string& group,
                                             CommOptions options) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(&parent);
  ZRT_CHECK(nccl != nullptr, "make_nccl_part: ", group, ": the parent communicator is '", parent.backend_name(),
            "', not nccl (split the flat nccl communicator)");
  return nccl->split(color, key, group, options);
}

std::unique_ptr<Communicator> make_nccl_communicator_mpi(int device, CommOptions options) {
#if ZERORT_WITH_MPI
  auto mpi = make_mpi_communicator(options);
  std::string id(sizeof(ncclUniqueId), '\0');
  if (mpi->rank() == 0) id = nccl_unique_id();
  static_assert(sizeof(ncclUniqueId) % sizeof(int32_t) == 0, "the id travels as int32 words");
  mpi->broadcast(id.data(), id.size() / sizeof(int32_t), DType::kInt32, 0)->wait();  // MPI_Bcast
  if (device < 0) {
    int count = 0;
    ZRT_CHECK_CUDA(cudaGetDeviceCount(&count));
    ZRT_CHECK(count > 0, "NCCL: no CUDA device is visible on rank ", mpi->rank());
    device = detect_launch_env().local_rank % count;
  }
  return make_nccl_communicator(mpi->rank(), mpi->size(), device, id, options);
#else
  (void)device;
  (void)options;
  ZRT_THROW("make_nccl_communicator_mpi: this build has no MPI; pass the unique id yourself "
            "(make_nccl_communicator) or use zerort.comm.init(backend='nccl') under torchrun");
#endif
}

}  // namespace zerort
