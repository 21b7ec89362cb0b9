#include "comm/nccl/nccl_work.h"

#include <thread>

#include "comm/cuda_streams.h"
#include "core/cuda_check.h"
#include "core/error.h"

namespace zerort {

void check_nccl(ncclResult_t result, const char* call, ncclComm_t comm, const char* file, int line) {
  if (result == ncclSuccess || result == ncclInProgress) return;
  const char* last = comm ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  throw CommError(file, line,
                  detail::concat(call, " failed: ", ncclGetErrorString(result),
                                 (last && *last) ? detail::concat(" (", last, ")") : std::string()));
}

std::shared_ptr<void> NcclState::pinned(size_t bytes, const std::shared_ptr<NcclState>& self) {
  if (bytes > kPinnedSlot) {
    void* p = nullptr;
    ZRT_CHECK_CUDA(cudaMallocHost(&p, bytes));
    return std::shared_ptr<void>(p, [](void* q) { cudaFreeHost(q); });
  }
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(pinned_mu);
    if (!pinned_free.empty()) {
      p = pinned_free.back();
      pinned_free.pop_back();
    }
  }
  if (!p) ZRT_CHECK_CUDA(cudaMallocHost(&p, kPinnedSlot));
  std::weak_ptr<NcclState> owner = self;
  return std::shared_ptr<void>(p, [owner](void* q) {
    if (auto st = owner.lock()) {
      std::lock_guard<std::mutex> lock(st->pinned_mu);
      st->pinned_free.push_back(q);
    } else {
      cudaFreeHost(q);
    }
  });
}

NcclState::~NcclState() {
  for (void* p : pinned_free) cudaFreeHost(p);
  // A communicator that timed out was aborted already; a healthy one is destroyed, unless
  // the CUDA runtime is already gone (interpreter shutdown), when the driver reclaims it.
  if (comm && !aborted.load() && cudaSetDevice(device) == cudaSuccess) {
    // Nonblocking: finalize, give it a bounded time to flush, then destroy (or abort).
    ncclResult_t state = ncclCommFinalize(comm);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
    }
    if (state == ncclSuccess)
      ncclCommDestroy(comm);
    else
      ncclCommAbort(comm);
  }
  if (stream) cudaStreamDestroy(stream);
}

bool NcclState::settle(std::chrono::steady_clock::time_point deadline, const char* what) {
  for (;;) {
    const ncclResult_t state = async_error();
    if (state == ncclSuccess) return true;
    if (state != ncclInProgress) {
      const std::string reason = detail::concat(what, ": ", ncclGetErrorString(state));
      try {
        check_nccl(state, what, comm, __FILE__, __LINE__);
      } catch (...) {
        abort(reason);
        throw;
      }
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

ncclResult_t NcclState::async_error() {
  std::lock_guard<std::mutex> lock(call_mu);
  check_usable();
  ncclResult_t state = ncclInProgress;
  ZRT_CHECK_NCCL(ncclCommGetAsyncError(comm, &state), comm);
  return state;
}

void NcclState::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(call_mu);
  if (aborted.load()) return;
  abort_reason = reason;
  aborted.store(true);
  if (comm) ncclCommAbort(comm);  // frees the communicator; its kernels stop waiting for peers
}

void NcclState::check_usable() const {
  ZRT_CHECK(!aborted.load(), "the NCCL communicator was aborted after an earlier failure (", abort_reason,
            "); it cannot run more collectives: exit and restart the job");
}

NcclWork::NcclWork(CollectiveDesc desc, std::chrono::milliseconds timeout, std::shared_ptr<NcclState> state,
                   cudaEvent_t done)
    : Work(std::move(desc), timeout), state_(std::move(state)), done_(done), timeout_(timeout) {}

NcclWork::~NcclWork() {
  // Dropped before its transfer finished (never waited, or it failed): the device may still
  // write the buffers it keeps alive, so they are parked for the life of the process.
  if (done_ && cudaEventQuery(done_) != cudaSuccess) retire_buffers();
  if (done_) cudaEventDestroy(done_);  // CUDA releases an unfinished event once it completes
}

bool NcclWork::query() {
  state_->check_usable();
  const cudaError_t q = cudaEventQuery(done_);
  if (q == cudaSuccess) return true;
  ZRT_CHECK(q == cudaErrorNotReady, desc().to_string(), ": cudaEventQuery failed: ", cudaGetErrorName(q), " (",
            cudaGetErrorString(q), ")");
  const ncclResult_t async = state_->async_error();
  if (async != ncclSuccess && async != ncclInProgress) {
    const std::string what = detail::concat(desc().to_string(), ": NCCL reported an asynchronous error");
    state_->abort(what);
    retire_buffers();
    check_nccl(async, what.c_str(), nullptr, __FILE__, __LINE__);
  }
  return false;
}

bool NcclWork::wait_until(std::chrono::steady_clock::time_point deadline) {
  // A host that needs the result (Note [allowed host waits], comm/stream_order.h): a bounded
  // poll, so a missing peer times out instead of blocking in cudaEventSynchronize. Counted once:
  // a result finished on the host (then(): the control values of the step's decision, a
  // barrier) as kStepDecision, a device buffer (state dicts, checkpoints) as kUserCall.
  if (!host_wait_counted_) {
    host_wait_counted_ = true;
    const bool host_result = has_then_locked();  // wait() holds the Work's lock
    cuda_stream_order(state_->device).count_host_wait(host_result ? HostWait::kStepDecision : HostWait::kUserCall);
  }
  for (;;) {
    if (query()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

bool NcclWork::join_compute_stream() {
  if (has_then()) return false;  // its result is finished on the host
  state_->check_usable();
  cuda_stream_order(state_->device).compute_after(done_);
  auto self = std::static_pointer_cast<NcclWork>(shared_from_this());
  if (!state_->watchdog.watch(std::move(self), std::chrono::steady_clock::now() + timeout_)) {
    wait();  // the communicator is closing: nothing watches the deadline but this wait
  }
  return true;
}

bool NcclWork::poll(std::chrono::steady_clock::time_point deadline) {
  try {
    if (query()) return true;
  } catch (const std::exception&) {
    return true;  // aborted: the reason is the communicator's, every later call throws it
  }
  if (std::chrono::steady_clock::now() < deadline) return false;
  on_timeout();
  return true;
}

void NcclWork::on_timeout() {
  state_->abort(detail::concat(desc().to_string(), " timed out"));
  retire_buffers();
}

}  // namespace zerort
