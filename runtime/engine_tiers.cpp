// Engine, where its state is made: the optimizer state's tier (Note [state tiers]), its files
// made on every rank, the mover and the reduce scratch off memory, stage 3's shard copies, the
// starting master kept, and the state store (the rest of the Engine's state is engine_state.cpp).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/bf16_state_store.h"
#include "runtime/device_gradient_store.h"
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
//   - kHost and kNvme with EngineOptions::gradient_on_device: the FP32 gradient on the model's
//     device instead, reduced into there as in memory (no scratch, no copies) and copied down by
//     the step piece by piece (Note [gradient on the device], runtime/device_gradient_store.h).
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
  ZRT_CHECK_AS(ConfigError, !options_.gradient_on_device || options_.state_tier != StateTier::kMemory,
               "Engine: gradient_on_device (offload_optimizer.gradient_on_device) keeps the FP32 gradient on the ",
               "device beside master, m and v off it; with the state in memory it is there already: set ",
               "offload_optimizer.device to 'cpu' or 'nvme', or drop gradient_on_device");
  if (options_.state_tier == StateTier::kMemory) return nullptr;
  ZRT_CHECK_AS(ConfigError, !policy_.replicated, "Engine: the optimizer state's tier '", tier_name(options_.state_tier),
               "' works at stages 1-3; got stage 0 (set offload_optimizer.device to 'none')");
  if (options_.state_tier == StateTier::kHost) {
    open_host_tier();
    return nullptr;
  }
  NvmeStateOptions nvme = options_.nvme;
  nvme.rank = world_.rank();
  nvme.with_gradient = !options_.gradient_on_device;  // Note [gradient on the device]: a DeviceGradientStore's
  std::unique_ptr<NvmeStateStore> file;
  std::string why;
  try {
    file = std::make_unique<NvmeStateStore>(static_cast<int64_t>(numel), options_.optimizer.state_dtype, nvme);
    open_mover();
    if (nvme.gradient_in_file || (host_mover_->device_memory() && !options_.gradient_on_device)) make_reduce_scratch();
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
  if (!options_.gradient_on_device) make_reduce_scratch();  // else the reduces reach the gradient
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
  if (options_.gradient_on_device) {  // kHost's or kNvme's (open_tier_files checked), without a gradient
    // The pieces: a record's chunk (rounded up to the direct-I/O alignment), or kHost's chunk_elements.
    const size_t piece = file ? file->chunk_elements() : options_.nvme.chunk_elements;
    std::unique_ptr<OptimizerStateStore> inner =
        file ? std::unique_ptr<OptimizerStateStore>(std::move(file))
             : std::make_unique<InMemoryStateStore>(std::move(master), options_.optimizer.state_dtype, false);
    at::Tensor grad = at::zeros({inner->numel()}, at::TensorOptions().dtype(at::kFloat).device(device_));
    return std::make_unique<DeviceGradientStore>(std::move(inner), std::move(grad), *host_mover_, piece);
  }
  if (file) return file;
  if (master.scalar_type() == at::kBFloat16) {  // the reduces reach its gradient through the scratch
    make_reduce_scratch();
    return std::make_unique<Bf16MasterStateStore>(std::move(master), options_.optimizer.state_dtype);
  }
  return std::make_unique<InMemoryStateStore>(std::move(master), options_.optimizer.state_dtype);
}

}  // namespace zerort
