// Engine, its state as callers read and load it: the optimizer state's tier, per-group views
// of the FP32 optimizer state and gradient, ranges of it in any tier, the whole master
// gathered, the checkpoint counters, and the working weights rebuilt from the master (the rest
// of the Engine is engine.cpp, engine_reduce.cpp and engine_units.cpp).
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "core/error.h"
#include "runtime/bf16_state_store.h"
#include "runtime/engine_parts.h"
#include "runtime/kernel_dispatch.h"

namespace zerort {

// Note [state tiers]: EngineOptions::state_tier is where this rank's master, m and v live.
//   - kMemory: with the FP32 gradient, on the model's device; whatever reads the master takes
//     the tensor.
//   - kHost (offload_optimizer "cpu" for a model on a GPU; stages 1-3): master, m, v and the
//     FP32 gradient in host memory, the step on the CPU, and the model's memory reached only
//     through a Mover's explicit copies (comm/staged_communicator.h). Each bucket's reduce runs
//     on the device into a scratch that first takes this rank's gradient so far, and goes back
//     to the host on the comm thread while backward goes on; the same sums as in memory, so
//     the same bits. AdamW writes each bucket's new low-precision shard into a host buffer
//     (OutputSegment::open), which is copied to the device as soon as the bucket is done, and
//     the bucket's all-gather starts while later buckets are still stepped. Stage 3's shard
//     copies (below) are on the device, so gathers never touch the host; with
//     EngineOptions::param_host (offload_param "cpu") they are in host memory instead, AdamW
//     writes them directly, and each gather copies its unit's shard to the device (on the comm
//     thread, so the unit prefetch moves it ahead of use), leaving the device the units in flight.
//     tests/cpp/test_engine_host_tier.cpp runs both on a CPU model, with the host Mover.
//   - kNvme (stages 1-3, a CPU model): in a file; the master is reached only through the
//     store: the step streams it through update(), and everything else that reads it (the
//     gathers of stage 3, refresh_params after a load, gather_master, read_state) reads ranges
//     of it.
// Off memory, a stage-3 unit is gathered once per forward and once per backward, too often
// to read and cast its FP32 shard each time, so each unit that is not persistent keeps this
// rank's low-precision shard apart (ShardCopies: 2 bytes per element of the shard at bf16):
// the step writes it as AdamW's low-precision output and the gather copies it into the unit.
// AdamW's output is the master's cast, so these are the bits the in-memory tier's gather
// casts (tests/python/test_offload_nvme.py compares them). The copies are in memory (the
// device's, for kHost), or with EngineOptions::param_nvme_path (offload_param nvme) one
// region each of a second file, read by the gather on the comm thread (so a unit prefetch
// reads ahead of use) and written by the step unit by unit behind AdamW (Note [RegionFile]).
// Then a rank's RAM holds no parameter but the units in flight, the persistent ones and two
// staging buffers of the largest unit's shard.
// The files are made on every rank before any state exists (open_tier_files), and a rank
// that cannot make its own fails every rank with one ConfigError naming it and why. The
// starting master goes into the file bucket by bucket as it is filled (keep_master), so the
// whole FP32 shard is never in memory, not even at initialize.

namespace {

// Every rank's `mine` (empty: no failure), as "rank r: ..." lines for the ranks that failed,
// on every rank alike (one all-gather of a fixed-size row per rank; messages are cut there).
std::string failures_across_ranks(Communicator& comm, const std::string& mine) {
  constexpr size_t kRowBytes = 1024;
  std::vector<int64_t> rows(comm.size() * kRowBytes / sizeof(int64_t), 0);
  std::vector<int64_t> row(kRowBytes / sizeof(int64_t), 0);
  std::memcpy(row.data(), mine.data(), std::min(mine.size(), kRowBytes - 1));
  comm.all_gather(row.data(), rows.data(), row.size(), DType::kInt64)->wait();
  std::string out;
  for (int r = 0; r < comm.size(); ++r) {
    const char* text = reinterpret_cast<const char*>(rows.data() + r * row.size());
    if (text[0] != '\0') out += detail::concat(out.empty() ? "" : "\n", "rank ", r, ": ", text);
  }
  return out;
}

}  // namespace

std::unique_ptr<NvmeStateStore> Engine::open_tier_files(size_t numel) {
  ZRT_CHECK_AS(ConfigError,
               options_.param_nvme_path.empty() || (policy_.units && options_.state_tier == StateTier::kNvme),
               "Engine: the parameters' NVMe tier (param_nvme_path) works at stage 3 with the optimizer state on "
               "NVMe too (set offload_optimizer.device to 'nvme'); got stage ",
               options_.stage, " with the state in ", tier_name(options_.state_tier));
  ZRT_CHECK_AS(ConfigError, !options_.param_host || (policy_.units && options_.state_tier == StateTier::kHost),
               "Engine: the parameters' host tier (param_host, offload_param 'cpu' for a model on a device) works at "
               "stage 3 with the optimizer state in host memory too (set offload_optimizer.device to 'cpu'); got "
               "stage ",
               options_.stage, " with the state in ", tier_name(options_.state_tier));
  if (options_.state_tier == StateTier::kMemory) return nullptr;
  ZRT_CHECK_AS(ConfigError, !policy_.replicated, "Engine: the optimizer state's tier '", tier_name(options_.state_tier),
               "' works at stages 1-3; got stage 0 (set offload_optimizer.device to 'none')");
  if (options_.state_tier == StateTier::kHost) {
    open_host_tier();
    return nullptr;
  }
  NvmeStateOptions nvme = options_.nvme;
  nvme.rank = world_.rank();
  std::unique_ptr<NvmeStateStore> file;
  std::string why;
  try {
    file = std::make_unique<NvmeStateStore>(static_cast<int64_t>(numel), options_.optimizer.state_dtype, nvme);
    open_mover();
    if (nvme.gradient_in_file || host_mover_->device_memory()) make_reduce_scratch();
    if (nvme.gradient_in_file) reduce_host_ = host_mover_->host_buffer(reduce_scratch_.numel() * sizeof(float));
    make_shard_copies();
  } catch (const std::exception& e) {  // a ConfigError, or the split's RAM not allocated: every rank hears
    why = e.what();
  }
  const std::string all = failures_across_ranks(world_, why);
  ZRT_CHECK_AS(ConfigError, all.empty(),
               "Engine: the NVMe state files could not be made on every rank, so none "
               "was written:\n",
               all);
  return file;
}

void Engine::open_mover() {
#if ZERORT_WITH_NCCL
  host_mover_ = device_.is_cuda() ? make_cuda_mover(device_.index()) : make_host_mover();
#else
  ZRT_CHECK_AS(ConfigError, device_.is_cpu(), "Engine: this build has no CUDA mover for the '",
               tier_name(options_.state_tier), "' tier on ", device_.str());
  host_mover_ = make_host_mover();
#endif
  size_t largest_bytes = 1;
  for (const auto& g : groups_) {
    for (const Bucket& b : g->buckets) largest_bytes = std::max(largest_bytes, b.opt_numel * dtype_size(g->dtype));
  }
  host_out_ = host_mover_->host_buffer(largest_bytes);
}

void Engine::open_host_tier() {
  open_mover();
  make_reduce_scratch();
  make_shard_copies();
}

at::ScalarType Engine::master_type() const {
  if (options_.optimizer.master_dtype != DType::kBFloat16) return at::kFloat;
  ZRT_CHECK_AS(ConfigError, !policy_.replicated && options_.state_tier == StateTier::kMemory && !replicas_,
               "Engine: a bf16 master (bf16.bf16_master_weights_and_grads, optimizer.master_dtype bf16) works at "
               "stages 1-3 with the optimizer state in memory, without hybrid sharding; got stage ",
               options_.stage, ", the state in ", tier_name(options_.state_tier), replicas_ ? ", hybrid sharding" : "",
               " (set offload_optimizer.device to 'none', zero_hpz/hybrid sharding off, stage 1-3, or drop "
               "bf16.bf16_master_weights_and_grads)");
  return at::kBFloat16;  // ShardOptimizer checks the precision is bf16
}

void Engine::make_reduce_scratch() {
  size_t largest = 0;
  for (const auto& g : groups_) {
    for (const Bucket& b : g->buckets) largest = std::max(largest, b.opt_numel);
  }
  reduce_scratch_ = at::empty({static_cast<int64_t>(largest)}, at::TensorOptions().dtype(at::kFloat).device(device_));
}

void Engine::make_shard_copies() {
  std::vector<size_t> bytes;
  for (const auto& g : groups_) {
    for (const Bucket& b : g->buckets) {
      bytes.resize(std::max(bytes.size(), b.index + 1), 0);
      if (policy_.units && !units_.gathered(b.index)) bytes[b.index] = b.opt_numel * dtype_size(g->dtype);
    }
  }
  if (options_.param_host) {
    shard_copies_ = ShardCopies(bytes, *host_mover_);
    return;
  }
  if (options_.param_nvme_path.empty()) {
    shard_copies_ = ShardCopies(bytes, nullptr, device_);
    return;
  }
  const ShardFileOptions file{options_.param_nvme_path, world_.rank(), options_.nvme.queue_depth,
                              options_.nvme.block_size, options_.nvme.io_backend};
  shard_copies_ = ShardCopies(bytes, &file, at::kCPU, host_mover_.get());  // read to the model through the mover
}

void Engine::keep_master(Bucket& b, DType dtype, const at::Tensor& mine, at::Tensor& master, NvmeStateStore* file) {
  const at::Tensor on_host = file == nullptr ? at::Tensor() : mine.to(at::kCPU).contiguous();  // a device's model
  if (file == nullptr) {
    master.narrow(0, static_cast<int64_t>(b.opt_offset), static_cast<int64_t>(b.opt_numel)).copy_(mine);
  } else {
    file->write_range(b.opt_offset, b.opt_numel, on_host.data_ptr<float>(), nullptr, nullptr);  // m and v stay 0
  }
  if (!shard_copies_.has(b.index)) return;  // in memory, or persistent: the step writes its working copy
  // Cast where the copy is: in host memory (kHost's beside the master, a file's staging) or the model's.
  const float* from = shard_copies_.on_host()       ? master.data_ptr<float>() + b.opt_offset
                      : shard_copies_.host_writes() ? on_host.data_ptr<float>()
                                                    : mine.data_ptr<float>();
  cast_from_f32_on(shard_copies_.host_writes() ? at::kCPU : device_, from, shard_copies_.begin_write(b.index), dtype,
                   b.opt_numel);
  shard_copies_.end_write(b.index);
}

std::unique_ptr<OptimizerStateStore> Engine::make_state_store(at::Tensor master, std::unique_ptr<NvmeStateStore> file) {
  if (file) return file;
  if (master.scalar_type() == at::kBFloat16) {  // the reduces reach its gradient through the scratch
    make_reduce_scratch();
    return std::make_unique<Bf16MasterStateStore>(std::move(master), options_.optimizer.state_dtype);
  }
  return std::make_unique<InMemoryStateStore>(std::move(master), options_.optimizer.state_dtype);
}

void Engine::cast_master(size_t offset, size_t n, void* out, DType dtype, bool out_on_host) const {
  OptimizerStateStore& state = optimizer_->state();
  if (out_on_host && state.tier() == StateTier::kMemory) {  // kHost's shard copies in host memory: beside the master
    cast_from_f32_on(at::kCPU, state.master().data_ptr<float>() + offset, out, dtype, n);
    return;
  }
  if (host_mover_ && state.tier() == StateTier::kMemory) {  // kHost: cast on the host, then one copy
    cast_from_f32_on(at::kCPU, state.master().data_ptr<float>() + offset, host_out_.get(), dtype, n);
    host_mover_->from_host(out, host_out_.get(), n * dtype_size(dtype));
    return;
  }
  if (state.tier() == StateTier::kMemory && state.master_dtype() == DType::kBFloat16) {  // bits, or widened
    const auto to = at::TensorOptions().dtype(scalar_type(dtype)).device(device_);
    at::from_blob(out, {static_cast<int64_t>(n)}, to)
        .copy_(state.master().narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(n)));
    return;
  }
  if (state.tier() == StateTier::kMemory) {
    cast_from_f32_on(device_, state.master().data_ptr<float>() + offset, out, dtype, n);
    return;
  }
  // kNvme: read through a bounded buffer and cast on the host; to the model's memory through
  // host_out_ and the mover (n: a bucket's at most, so a piece fits host_out_).
  constexpr size_t kPiece = size_t{1} << 20;
  std::vector<float> piece(std::min(n, kPiece));
  for (size_t at = 0; at < n; at += kPiece) {
    const size_t count = std::min(kPiece, n - at);
    state.read_range(offset + at, count, piece.data(), nullptr, nullptr);
    char* dest = static_cast<char*>(out) + at * dtype_size(dtype);
    cast_from_f32_on(at::kCPU, piece.data(), out_on_host ? dest : host_out_.get(), dtype, count);
    if (!out_on_host) host_mover_->from_host(dest, host_out_.get(), count * dtype_size(dtype));
  }
}

void Engine::fill_own_chunk(const Bucket& b) {
  if (shard_copies_.has(b.index)) {
    shard_copies_.read(b.index, own_chunk(b));
  } else {
    cast_master(b.opt_offset, b.opt_numel, own_chunk(b), groups_[b.group]->dtype);
  }
}

namespace {

at::ScalarType array_type(StateArray array, DType state_dtype) {
  return array == StateArray::kMaster ? at::kFloat : scalar_type(state_dtype);
}

}  // namespace

at::Tensor Engine::read_state(StateArray array, size_t offset, size_t n) const {
  settle_update();  // Note [overlapped step]
  OptimizerStateStore& state = optimizer_->state();
  at::Tensor out =
      at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(array_type(array, state.state_dtype())));
  void* p = out.data_ptr();
  state.read_range(offset, n, array == StateArray::kMaster ? static_cast<float*>(p) : nullptr,
                   array == StateArray::kExpAvg ? p : nullptr, array == StateArray::kExpAvgSq ? p : nullptr);
  return out;
}

void Engine::write_state(StateArray array, size_t offset, const at::Tensor& values) {
  settle_update();
  OptimizerStateStore& state = optimizer_->state();
  const at::ScalarType type = array_type(array, state.state_dtype());
  ZRT_CHECK_AS(UsageError, values.defined() && values.dim() == 1 && values.scalar_type() == type,
               "Engine.write_state: values must be a 1-D ", c10::toString(type), " tensor");
  const at::Tensor host = values.to(at::kCPU).contiguous();
  const void* p = host.data_ptr();
  state.write_range(offset, static_cast<size_t>(host.numel()),
                    array == StateArray::kMaster ? static_cast<const float*>(p) : nullptr,
                    array == StateArray::kExpAvg ? p : nullptr, array == StateArray::kExpAvgSq ? p : nullptr);
}

const Engine::Group& Engine::group(size_t g) const {
  ZRT_CHECK(g < groups_.size(), "Engine: group ", g, " does not exist (", groups_.size(), " groups)");
  return *groups_[g];
}
size_t Engine::numel(size_t g) const { return group(g).numel; }
size_t Engine::param_offset(size_t g, size_t i) const {
  ZRT_CHECK(i < group(g).params.size(), "Engine: parameter ", i, " of group ", g, " does not exist");
  return group(g).param_offset[i];
}
size_t Engine::bucket_of(size_t g, size_t i) const {
  param_offset(g, i);  // checks g and i
  return group(g).buckets[group(g).param_bucket[i]].index;
}
const at::Tensor& Engine::flat_params(size_t g) const { return group(g).flat_params; }
const at::Tensor& Engine::flat_grads(size_t g) const { return group(g).flat_grads; }
at::Tensor Engine::optimizer_slice(const at::Tensor& t, size_t g) const {
  return t.narrow(0, static_cast<int64_t>(group(g).opt_offset), static_cast<int64_t>(group(g).opt_numel));
}
at::Tensor Engine::master(size_t g) const {
  settle_update();
  return optimizer_slice(optimizer_->state().master(), g);
}
at::Tensor Engine::exp_avg(size_t g) const {
  settle_update();
  return optimizer_slice(optimizer_->state().exp_avg(), g);
}
at::Tensor Engine::exp_avg_sq(size_t g) const {
  settle_update();
  return optimizer_slice(optimizer_->state().exp_avg_sq(), g);
}
at::Tensor Engine::grad(size_t g) const {
  settle_update();
  OptimizerStateStore& state = optimizer_->state();
  if (state.gradient_in_memory()) return optimizer_slice(state.grad(), g);
  at::Tensor out = at::empty({static_cast<int64_t>(group(g).opt_numel)},
                             at::TensorOptions().dtype(at::kFloat).device(state.device()));
  state.read_grad(group(g).opt_offset, group(g).opt_numel, out.data_ptr<float>());
  return out;
}

size_t Engine::grad_shard_bytes() const {
  const OptimizerStateStore& state = optimizer_->state();
  if (state.master_dtype() == DType::kBFloat16) {  // the bf16 shard and the reduces' FP32 scratch
    return static_cast<size_t>(state.grad().numel()) * 2 + static_cast<size_t>(reduce_scratch_.numel()) * sizeof(float);
  }
  const at::Tensor& held = state.gradient_in_memory() ? state.grad() : reduce_scratch_;
  const bool host_tier = host_mover_ && state.tier() == StateTier::kMemory;  // and its reduce scratch on the device
  return static_cast<size_t>(held.numel() + (host_tier ? reduce_scratch_.numel() : 0)) * sizeof(float);
}

StateTierStats Engine::state_tier_stats() const {
  StateTierStats s = optimizer_->state().tier_stats();
  if (host_mover_ && s.tier == StateTier::kMemory)
    s.tier = StateTier::kHost;  // a store in (host) memory beside a device model
  return s;
}

at::Tensor Engine::gather_master(size_t g) const {
  settle_update();
  const Group& grp = group(g);
  const int64_t padded =
      grp.buckets.empty()
          ? 0
          : static_cast<int64_t>(grp.buckets.back().flat_offset + grp.buckets.back().layout.padded_numel());
  at::Tensor out = at::empty({padded}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (const Bucket& b : grp.buckets) {
    const int64_t n = static_cast<int64_t>(b.opt_numel);
    const at::Tensor mine = (optimizer_->state().tier() == StateTier::kMemory
                                 ? optimizer_->state().master().narrow(0, static_cast<int64_t>(b.opt_offset), n)
                                 : read_state(StateArray::kMaster, b.opt_offset, b.opt_numel))
                                .to(device_, at::kFloat);  // kHost: from host memory; a bf16 master widened
    if (policy_.replicated) {                              // every rank holds it all
      out.narrow(0, static_cast<int64_t>(b.flat_offset), n).copy_(mine);
    } else {
      shard_
          .all_gather(mine.data_ptr<float>(), out.data_ptr<float>() + b.flat_offset, b.opt_numel, DType::kFloat32,
                      static_cast<int64_t>(b.index))
          ->wait();
    }
  }
  return out;
}

// Checkpoints: the counters beside the optimizer tensors.
Engine::Counters Engine::counters() const {
  return Counters{global_step_, skipped_steps_, micro_steps_, optimizer_->adam_steps(), optimizer_->scaler_state()};
}

void Engine::load_counters(const Counters& c) {
  ZRT_CHECK(c.global_step >= 0 && c.skipped_steps >= 0 && c.skipped_steps <= c.global_step && c.micro_steps >= 0,
            "checkpoint: inconsistent step counters (global ", c.global_step, ", skipped ", c.skipped_steps, ", micro ",
            c.micro_steps, ")");
  settle_update();
  optimizer_->load_state(c.scaler, c.adam_steps);
  global_step_ = c.global_step;
  skipped_steps_ = c.skipped_steps;
  micro_steps_ = c.micro_steps;
  restart_window_sums();  // a load starts the window afresh (Note [hybrid sharding])
}

void Engine::refresh_params() {
  settle_update();
  wait_param_gathers();                  // none may write a working copy after this fills it
  if (secondary_) secondary_->forget();  // the loaded weights are new (Note [secondary shards])
  for (Bucket* b : buckets_) {           // shard copies first (See Note [state tiers])
    if (shard_copies_.has(b->index)) {
      cast_master(b->opt_offset, b->opt_numel, shard_copies_.begin_write(b->index), groups_[b->group]->dtype,
                  shard_copies_.host_writes());
      shard_copies_.end_write(b->index);
    }
  }
  for (Bucket* b : whole_buckets()) {  // released units take the master's values when gathered
    fill_own_chunk(*b);
    if (!policy_.replicated) gather_working_copy(*b)->wait();
  }
}

std::vector<std::array<size_t, 4>> Engine::bucket_layout(size_t g) const {
  std::vector<std::array<size_t, 4>> out;
  for (const Bucket& b : group(g).buckets) {
    out.push_back({b.flat_offset, b.layout.padded_numel(), b.layout.shard_numel(), b.opt_offset});
  }
  return out;
}

}  // namespace zerort
