// The compute stream on the engine's own threads: torch's ops that the engine runs there (packing
// a bucket, stage 0's add, a unit's storage) go on the stream the user's work is on, as its
// kernels and collectives do (Note [stream order], comm/stream_order.h).
#pragma once

#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <optional>

namespace zerort {

// Makes `stream` torch's current stream on this thread for a scope (nothing when unset: a CPU
// model, or a CUDA model before its first entry).
class OnComputeStream {
 public:
  explicit OnComputeStream(const std::optional<c10::Stream>& stream) {
    if (stream) guard_.emplace(*stream);
  }

 private:
  std::optional<c10::StreamGuard> guard_;
};

}  // namespace zerort
