#include "comm/nccl/nccl_work.h"

#include <thread>

#include "comm/cuda_check.h"
#include "comm/error.h"

namespace zerort {

void check_nccl(ncclResult_t result, const char* call, ncclComm_t comm, const char* file, int line) {
  if (result == ncclSuccess || result == ncclInProgress) return;
  const char* last = comm ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  throw Error(file, line, detail::concat(call, " failed: ", ncclGetErrorString(result),
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
  if (comm && !aborted.load() && cudaSetDevice(device) == cudaSuccess) ncclCommDestroy(comm);
  if (input_ready) cudaEventDestroy(input_ready);
  if (stream) cudaStreamDestroy(stream);
}

bool NcclState::settle(std::chrono::steady_clock::time_point deadline, const char* what) {
  for (;;) {
    ncclResult_t state = ncclInProgress;
    ZRT_CHECK_NCCL(ncclCommGetAsyncError(comm, &state), comm);
    if (state == ncclSuccess) return true;
    if (state != ncclInProgress) {
      check_nccl(state, what, comm, __FILE__, __LINE__);
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclState::abort(const std::string& reason) {
  bool expected = false;
  if (!aborted.compare_exchange_strong(expected, true)) return;
  abort_reason = reason;
  ncclCommAbort(comm);  // frees the communicator; its kernels stop waiting for peers
}

void NcclState::check_usable() const {
  ZRT_CHECK(!aborted.load(), "the NCCL communicator was aborted after an earlier failure (", abort_reason,
            "); it cannot run more collectives: exit and restart the job");
}

NcclWork::NcclWork(CollectiveDesc desc, std::chrono::milliseconds timeout, std::shared_ptr<NcclState> state,
                   cudaEvent_t done)
    : Work(std::move(desc), timeout), state_(std::move(state)), done_(done) {}

NcclWork::~NcclWork() {
  // An unfinished event is released by CUDA once it completes; buffers it guards were
  // handed to retire_buffers() on timeout, or are still referenced by this Work's owner.
  if (done_) cudaEventDestroy(done_);
}

bool NcclWork::wait_until(std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    state_->check_usable();
    const cudaError_t q = cudaEventQuery(done_);
    if (q == cudaSuccess) return true;
    ZRT_CHECK(q == cudaErrorNotReady, desc().to_string(), ": cudaEventQuery failed: ", cudaGetErrorName(q), " (",
              cudaGetErrorString(q), ")");
    ncclResult_t async = ncclSuccess;
    ZRT_CHECK_NCCL(ncclCommGetAsyncError(state_->comm, &async), state_->comm);
    if (async != ncclSuccess && async != ncclInProgress) {
      const std::string what = detail::concat(desc().to_string(), ": NCCL reported an asynchronous error");
      check_nccl(async, what.c_str(), state_->comm, __FILE__, __LINE__);
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void NcclWork::on_timeout() {
  state_->abort(detail::concat(desc().to_string(), " timed out"));
  retire_buffers();
}

}  // namespace zerort
