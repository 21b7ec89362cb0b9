// Engine test cases that run on any Communicator (in-process threads or MPI processes):
// a small MLP trained by the Engine (stages 0-3), and a single-process reference that
// computes the same thing another way (FP64 mean gradient over all ranks' micro-batches,
// FP64 AdamW on an FP32 master).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "comm/communicator.h"
#include "runtime/engine.h"

namespace zerort::testing {

struct EngineRun {
  std::vector<float> master;     // full FP32 master, gathered from all ranks
  std::vector<uint16_t> params;  // full low-precision parameters (bits)
  std::vector<StepStats> stats;  // one per step() call
  std::vector<double> scales;    // loss scale after each boundary
  int64_t adam_steps = 0;        // optimizer updates applied (skips excluded)
};

struct RunConfig {
  EngineOptions options;
  int steps = 20;  // optimizer boundaries
  // Called after backward, before step(): may corrupt this rank's gradients (params[i].grad()).
  std::function<void(std::vector<at::Tensor>& params, int step, int rank)> after_backward;
  int passes = 1;  // backward passes per micro-step, each on its own micro-batch; they add up
  // After each pass, report every gradient to grad_ready() in backward's order, as the
  // Python engine's post-accumulate-grad hooks do (buckets then reduce during backward).
  bool report_grads = false;
  // When it returns true, this rank runs no backward pass in that micro-step.
  std::function<bool(int step, int rank, int64_t micro)> skip_backward;
  // Stage 3: the Engine's units (default_units() when empty). Each pass gathers them for
  // forward (prefetching the next), releases them, gathers them again in reverse for
  // backward, as the Python engine's module hooks do; reported gradients release a unit.
  std::vector<UnitSpec> units;
  // This rank's ShardGroups (hybrid sharding, secondary shards); the whole world when empty.
  std::function<ShardGroups(int rank)> groups;
};

// The MLP's parameters (13 -> 31 -> 7 with an empty one): FP32 leaves, the same on every
// call and every process.
std::vector<at::Tensor> init_params();
// Its stage-3 units in forward order: fc1's weight and bias, the empty parameter alone,
// fc2's weight, and fc2's bias persistent.
std::vector<UnitSpec> default_units();
EngineOptions default_options(int stage, DType precision);
// A (world, stage, precision, accumulation) grid case's run: default_options with that window.
RunConfig grid_config(const std::tuple<int, int, DType, int64_t>& grid_case, int steps);
// Two backward passes per micro-step over 5 steps, each gradient reported as the hooks report
// it (each pass reduced on its own): bf16 at this stage and accumulation.
RunConfig two_pass_config(int stage, int64_t gas);
// "W2_stage3_bf16_gas1": the test name of a (world, stage, precision, accumulation) grid case.
std::string grid_case_name(const std::tuple<int, int, DType, int64_t>& grid_case);
EngineRun run_engine(Communicator& comm, const RunConfig& config);
// run_engine on W in-process ranks (threads), after setup(comm) on each when given; a rank
// that throws fails the test.
std::vector<EngineRun> run_all(int world, const RunConfig& config,
                               const std::function<void(Communicator&)>& setup = {});

// max |a - b| / max |b|: how far a run's FP32 values are from a reference, relative to its largest.
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b);

struct Reference {
  std::vector<float> master;
  std::vector<double> grad_norms;  // per step, before clipping
};
// What W ranks should compute together, computed by one process. scales[i] is the loss
// scale step i ran with (1 for bf16); the reference rounds gradients as the engine does.
Reference run_reference(int world, const RunConfig& config, const std::vector<double>& scales);

}  // namespace zerort::testing
