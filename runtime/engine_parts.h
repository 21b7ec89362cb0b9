// Engine's inner parts (buckets and groups), shared by engine.cpp, engine_reduce.cpp,
// engine_units.cpp, engine_tiers.cpp, engine_state.cpp and engine_update.cpp only.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <vector>

#include "runtime/engine.h"

// pthread_exit unwinds a thread with a "forced unwind" that a catch (...) must rethrow:
// swallowing it aborts the process. CPython ends a thread this way when it asks for the
// GIL during interpreter shutdown.
#if defined(__GLIBCXX__)
#include <cxxabi.h>
#define ZRT_RETHROW_FORCED_UNWIND       \
  catch (const abi::__forced_unwind&) { \
    throw;                              \
  }
#else
#define ZRT_RETHROW_FORCED_UNWIND
#endif

namespace zerort {

inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The ATen dtype of a bucket group's DType: bf16, f16, else f32.
inline at::ScalarType scalar_type(DType d) {
  return d == DType::kBFloat16 ? at::kBFloat16 : d == DType::kFloat16 ? at::kHalf : at::kFloat;
}

// A run of consecutive parameters (in reduce order) with its own W-way shard layout; at
// stage 3, a unit. Its working copy is unit `index` of the Engine's UnitCache, its pack
// buffer bucket `index` of its GradPacker.
struct Engine::Bucket {
  size_t group = 0;
  size_t index = 0;            // in buckets_: the reduce order, and the collectives' tag
  std::vector<size_t> params;  // indices into the group's params
  ShardLayout layout{{}, 1, 1};
  size_t flat_offset = 0;  // in the group's flat buffers
  size_t opt_offset = 0;   // in the optimizer's master
  size_t opt_numel = 0;    // shard_numel (stages 1-3) or padded_numel (stage 0)
  bool queued = false;     // its reduce is queued this round
  size_t waiting = 0;      // parameters whose gradient is not complete yet
  // Hybrid: this window's gradient shard is summed across the groups (comm thread; Note
  // [hybrid sharding]); a later reduce in the window adds a summed increment.
  bool summed_across = false;
};

struct Engine::Group {
  DType dtype;
  std::vector<at::Tensor> params;
  std::vector<std::vector<int64_t>> shapes;  // stage 3 empties released parameters
  std::vector<size_t> param_offset;          // in the flat buffers
  std::vector<size_t> param_bucket;          // index into buckets
  std::vector<Bucket> buckets;
  size_t numel = 0;
  at::Tensor flat_params, flat_grads;
  size_t opt_offset = 0, opt_numel = 0;
};

}  // namespace zerort
