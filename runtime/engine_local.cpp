// Engine at W = 1, and the compute stream it is told at each entry.
//
// Note [W = 1 is local]
// When no other rank holds a part of the state (one rank, no hybrid replicas, no hpZ
// secondary shards), there is nothing to communicate:
// - A bucket's reduce is the accumulate of its low-precision gradient into the FP32 gradient
//   (sum_chunks_to_f32 over one chunk, the arithmetic the communicator's W = 1 path ran, so the
//   same bits), on the compute stream; no collective is called and the call log stays empty.
// - A stage-3 unit's gather is the cast of its FP32 master into the working copy: this rank's
//   chunk is the whole unit, so the all-gather is skipped and the parameters view the copy.
// - The queue of reduces and gathers runs on the thread that fills it (run_here_locked): a
//   backward hook, forward's gather, step's drain. No comm-thread round trip: on a GPU each
//   op is a kernel launch on the compute stream; on a CPU it runs where the hook runs.
// The comm thread still exists (an engine's shape does not depend on W) but takes no op.
#include "core/error.h"
#include "runtime/engine_parts.h"
#include "zerort/config.h"
#if ZERORT_WITH_CUDA
#include "comm/cuda_streams.h"
#endif

namespace zerort {

bool Engine::local_only() const { return shard_.size() == 1 && replicas_ == nullptr && secondary_ == nullptr; }

void Engine::run_here_locked(std::unique_lock<std::mutex>& lock) {
  // Another thread running an op of the queue (a hook beside forward's gather) finishes it
  // first, so the ops keep the queue's order and never overlap.
  while (!queue_.empty()) {
    cv_.wait(lock, [&] { return !busy_; });
    if (!queue_.empty()) run_next_locked(lock);
  }
}

void Engine::set_compute_stream(int64_t stream_id, int device_index, int device_type, uintptr_t cuda_stream) {
  if (!device_.is_cuda()) return;  // a CPU model's work has no stream
  const c10::Stream stream = c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(device_index),
                                                  static_cast<c10::DeviceType>(device_type));
  ZRT_CHECK(stream.device() == device_ || (device_.index() < 0 && stream.device_type() == device_.type()),
            "Engine.set_compute_stream: the stream is on ", stream.device().str(), " but the model is on ",
            device_.str(), "; run the engine under a stream of the model's device");
  {
    std::lock_guard<std::mutex> lock(mu_);
    compute_stream_ = stream;
  }
#if ZERORT_WITH_CUDA
  cuda_stream_order(device_index).set_compute(reinterpret_cast<cudaStream_t>(cuda_stream));
#else
  (void)cuda_stream;
#endif
}

}  // namespace zerort
