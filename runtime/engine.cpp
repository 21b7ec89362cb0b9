// Engine: construction (buckets, flat buffers, starting values), accessors, the step and
// the checkpoint counters. Backward's gradient path and the comm thread are in
// engine_reduce.cpp; stage 3's gathers and releases in engine_units.cpp; the update at a
// boundary in engine_update.cpp; the state's tiers in engine_tiers.cpp, its readers in engine_state.cpp.
#include "runtime/engine.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "partition/bucket_plan.h"
#include "runtime/engine_parts.h"
#include "runtime/kernel_dispatch.h"

namespace zerort {

namespace {

void check_params(const std::vector<at::Tensor>& params, const char* what) {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    ZRT_CHECK(p.defined(), "Engine: ", what, " ", i, " is undefined");
    ZRT_CHECK(p.scalar_type() == at::kFloat, "Engine: ", what, " ", i, " has dtype ", c10::toString(p.scalar_type()),
              "; build the model in float32 (the engine keeps the FP32 "
              "master and casts the working copy itself)");
    ZRT_CHECK(p.requires_grad() && p.is_leaf(), "Engine: ", what, " ", i, " must be a leaf tensor that requires grad");
  }
}

// The one device of every parameter not on the meta device (CPU when there are none), and
// a communicator that moves that device's memory.
c10::Device common_device(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                          const Communicator& comm) {
  c10::Device device(c10::kCPU);
  bool first = true;
  for (const auto* list : {&a, &b}) {
    for (size_t i = 0; i < list->size(); ++i) {
      const at::Tensor& p = (*list)[i];
      if (!p.defined() || p.is_meta()) continue;  // meta: materialized on the model's device
      if (first) device = p.device();
      first = false;
      ZRT_CHECK_AS(DeviceError, p.device() == device, "Engine: ", list == &a ? "parameter " : "fp32 parameter ", i,
                   " is on ", p.device().str(), " but the first parameter is on ", device.str(),
                   "; move the whole model to one device first");
    }
  }
  check_device_supported(device, "the model");
  ZRT_CHECK_AS(ConfigError, comm.device_memory() == device.is_cuda(), "Engine: the model is on ", device.str(),
               " but the '", comm.backend_name(), "' communicator moves ", comm.device_memory() ? "device" : "host",
               " buffers; ",
               device.is_cuda() ? "CUDA models need the nccl backend, or mpi/gloo staged for CUDA"
                                : "a device communicator needs a CUDA model (model.cuda())");
  return device;
}

const EngineOptions& validated(const EngineOptions& o) {
  ZRT_CHECK_AS(ConfigError, o.stage >= 0 && o.stage <= 3, "stage must be 0, 1, 2 or 3, got ", o.stage);
  ZRT_CHECK_AS(ConfigError, o.reduce_bucket_numel >= 1, "reduce_bucket_numel must be >= 1, got ",
               o.reduce_bucket_numel);
  return o;
}

// Stage 3: the units as bucket plans, after checking they cover every parameter once.
std::vector<BucketPlan> unit_plans(const std::vector<UnitSpec>& units, const std::vector<size_t>& sizes, int world,
                                   size_t alignment) {
  std::vector<int> seen(sizes.size(), 0);
  std::vector<BucketPlan> plans;
  for (size_t u = 0; u < units.size(); ++u) {
    std::vector<size_t> numels;
    for (size_t i : units[u].params) {
      ZRT_CHECK(i < sizes.size(), "Engine: unit ", u, " names parameter ", i, " but there are ", sizes.size());
      ZRT_CHECK(seen[i]++ == 0, "Engine: parameter ", i, " is in more than one unit");
      numels.push_back(sizes[i]);
    }
    plans.push_back({units[u].params, ShardLayout(numels, world, alignment)});
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    ZRT_CHECK(seen[i] == 1, "Engine: parameter ", i, " is in no unit; stage 3's units must cover every parameter");
  }
  return plans;
}

// A part of the world that an engine calls beside it: its calls go into the world's log, and
// are checked as the world's are (Note [checked calls]), from the same point on every rank.
void join_world(Communicator& part, Communicator& world) {
  part.share_call_log(world);
  if (world.checks_each_call()) part.check_each_call();
}

// The communicator the state is sharded over: the world, or the hybrid group of `groups`,
// checked against the world and the options, its calls and its parts' in the world's log
// (Note [hybrid sharding]).
Communicator& shard_part(Communicator& world, const ShardGroups& groups, const EngineOptions& o) {
  if (groups.shard == nullptr) {
    ZRT_CHECK(groups.replicas == nullptr, "Engine: ShardGroups.replicas without ShardGroups.shard");
    return world;
  }
  Communicator& shard = *groups.shard;
  ZRT_CHECK(groups.replicas != nullptr, "Engine: ShardGroups.shard without ShardGroups.replicas");
  const Communicator& replicas = *groups.replicas;
  ZRT_CHECK(
      shard.size() * replicas.size() == world.size() && world.rank() == replicas.rank() * shard.size() + shard.rank(),
      "Engine: rank ", world.rank(), " of ", world.size(), " is not group ", replicas.rank(), " x ", shard.size(),
      " + index ", shard.rank(), " (", replicas.size(), " groups of ", shard.size(), " consecutive ranks)");
  ZRT_CHECK_AS(ConfigError, o.stage > 0,
               "shard_size: stage 0 keeps the whole state on every rank, so there is "
               "nothing to shard within a group; use stage 1, 2 or 3, or drop shard_size");
  ZRT_CHECK_AS(ConfigError, o.state_tier == StateTier::kMemory && o.param_nvme_path.empty() && !o.param_host,
               "shard_size: hybrid sharding keeps the state in memory in this version, and the config offloads it "
               "(offload_optimizer / offload_param '",
               tier_name(o.state_tier), "'); drop shard_size, or the offload sections");
  // nccl: all three on the device (Note [nccl parts]); staged: host replicas (Note [staging once]).
  ZRT_CHECK_AS(ConfigError,
               shard.device_memory() == world.device_memory() && (!replicas.device_memory() || world.device_memory()),
               "shard_size: the shard group must move the world's memory, and the replicas the world's or host "
               "memory; here the world is '",
               world.backend_name(), "', the group '", shard.backend_name(), "' and the replicas '",
               replicas.backend_name(), "' (zerort.comm.topology.grid_parts makes them for the world's backend)");
  join_world(shard, world);
  join_world(*groups.replicas, world);
  return shard;
}

// The secondary shards of Note [secondary shards] over `part`, checked against the shard
// group; nullptr without a part.
std::unique_ptr<SecondaryShards> secondary_shards(Communicator* part, Communicator& shard, Communicator& world,
                                                  bool units, size_t buckets) {
  if (part == nullptr) return nullptr;
  ZRT_CHECK_AS(ConfigError, units,
               "stage3.secondary_shard_size (zero_hpz_partition_size): the secondary shards serve stage 3's "
               "re-gathers; at stages 1-2 drop it (or set it to 1)");
  const int g = part->size();
  ZRT_CHECK_AS(ConfigError, shard.size() % g == 0 && shard.rank() % g == part->rank(),
               "stage3.secondary_shard_size (zero_hpz_partition_size): groups of ", g,
               " ranks do not fit within the groups of ", shard.size(),
               " ranks that shard the state (shard_size, or the world); use a divisor of ", shard.size());
  join_world(*part, world);
  return std::make_unique<SecondaryShards>(part, buckets);
}

}  // namespace

Engine::Engine(std::vector<at::Tensor> params, Communicator& comm, EngineOptions options,
               std::vector<at::Tensor> fp32_params, std::vector<UnitSpec> units, ShardGroups groups)
    : world_(comm), shard_(shard_part(comm, groups, options)), replicas_(groups.replicas), replica_wire_(groups.wire),
      options_(validated(options)), policy_(ReducePolicy::for_stage(options_.stage)),
      device_(common_device(params, fp32_params, comm)) {
  ZRT_CHECK(policy_.units || units.empty(), "Engine: units are for stage 3; stages 0-2 plan their buckets by size");
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  size_t opt_total = 0, bucket_count = 0;
  auto add_group = [&](std::vector<at::Tensor> ps, DType dtype, const char* what, const std::vector<UnitSpec>& plan) {
    check_params(ps, what);
    auto g = std::make_unique<Group>();
    g->dtype = dtype;
    g->params = std::move(ps);
    const size_t n = g->params.size();
    g->param_offset.resize(n);
    g->param_bucket.resize(n);
    // Buckets in reverse parameter order: the order backward completes gradients. At
    // stage 3 the caller's units instead, in its order.
    std::vector<size_t> sizes;
    for (const auto& p : g->params) {
      sizes.push_back(static_cast<size_t>(p.numel()));
      g->shapes.push_back(p.sizes().vec());
    }
    size_t flat = 0;
    const std::vector<BucketPlan> plans =
        plan.empty() ? plan_buckets(sizes, shard_.size(), options_.reduce_bucket_numel, options_.alignment)
                     : unit_plans(plan, sizes, shard_.size(), options_.alignment);
    for (size_t u = 0; u < plans.size(); ++u) {
      Bucket b;
      b.group = groups_.size();
      b.index = bucket_count++;
      b.params = plans[u].params;
      b.layout = plans[u].layout;
      b.flat_offset = flat;
      b.opt_offset = opt_total;
      b.opt_numel = policy_.replicated ? b.layout.padded_numel() : b.layout.shard_numel();
      for (size_t j = 0; j < b.params.size(); ++j) {
        g->param_offset[b.params[j]] = flat + b.layout.param_offset(j);
        g->param_bucket[b.params[j]] = g->buckets.size();
      }
      flat += b.layout.padded_numel();
      opt_total += b.opt_numel;
      g->numel += b.layout.numel();
      g->buckets.push_back(std::move(b));
    }
    const int64_t padded = static_cast<int64_t>(flat);
    const auto opts = at::TensorOptions().dtype(scalar_type(dtype)).device(device_);
    if (!policy_.units) g->flat_params = at::empty({padded}, opts);
    for (size_t u = 0; u < g->buckets.size(); ++u) {  // unit b.index of units_, in the same order
      const Bucket& b = g->buckets[u];
      const int64_t bn = static_cast<int64_t>(b.layout.padded_numel());
      // Units: storage of their own, emptied while released (See Note [released storage]);
      // they start released unless persistent. Otherwise a view of the group's flat buffer.
      at::Tensor full =
          policy_.units ? at::empty({bn}, opts) : g->flat_params.narrow(0, static_cast<int64_t>(b.flat_offset), bn);
      std::vector<UnitCache::ParamView> views;
      for (size_t j = 0; j < b.params.size(); ++j) {
        views.push_back({&g->params[b.params[j]], static_cast<int64_t>(b.layout.param_offset(j)),
                         static_cast<int64_t>(b.layout.param_numel(j)), g->shapes[b.params[j]]});
      }
      units_.add(std::move(full), b.layout.padded_numel() * dtype_size(dtype), plan.empty() || plan[u].persistent,
                 std::move(views), plan.empty() ? std::string() : plan[u].name);
    }
    if (!policy_.packs()) g->flat_grads = at::zeros({padded}, opts);  // stages 0, 1: whole
    g->opt_offset = g->buckets.empty() ? opt_total : g->buckets.front().opt_offset;
    g->opt_numel = opt_total - g->opt_offset;
    groups_.push_back(std::move(g));
  };
  add_group(std::move(params), options_.optimizer.precision, "parameter", units);
  ZRT_CHECK(!policy_.units || !units.empty() || groups_[0]->params.empty(),
            "Engine: stage 3 needs units (UnitSpec) covering the parameters");
  std::vector<UnitSpec> fp32_units;  // stage 3: FP32-module parameters stay whole
  if (policy_.units && !fp32_params.empty()) {
    fp32_units.push_back({{}, true});
    for (size_t i = 0; i < fp32_params.size(); ++i) fp32_units[0].params.push_back(i);
  }
  if (!fp32_params.empty()) add_group(std::move(fp32_params), DType::kFloat32, "fp32 parameter", fp32_units);
  std::unique_ptr<NvmeStateStore> state_file = open_tier_files(opt_total);  // before any state exists
  const at::ScalarType master_dtype = master_type();  // a bf16 master in memory only; a file's fills bucket by bucket
  at::Tensor master = state_file    ? at::Tensor()
                      : host_mover_ ? at::empty({static_cast<int64_t>(opt_total)}, f32.device(at::kCPU))
                                    : at::empty({static_cast<int64_t>(opt_total)}, f32.dtype(master_dtype));
  for (auto& g : groups_) {
    for (Bucket& b : g->buckets) fill_bucket(*g, b, master, state_file.get());
    for (size_t i = 0; i < g->params.size() && !policy_.packs(); ++i) {
      at::Tensor& p = g->params[i];
      const int64_t off = static_cast<int64_t>(g->param_offset[i]);
      p.mutable_grad() = g->flat_grads.narrow(0, off, p.numel()).view(p.sizes());
    }
  }
  std::vector<GradPacker::BucketShape> packs;
  for (auto& g : groups_) {
    reported_.emplace_back(g->params.size(), false);
    for (Bucket& b : g->buckets) {
      b.waiting = b.params.size();
      buckets_.push_back(&b);
      packs.push_back({b.params.size(), b.layout.padded_numel() * dtype_size(g->dtype), scalar_type(g->dtype)});
    }
  }
  packer_ =
      std::make_unique<GradPacker>(std::move(packs), policy_.pack == ReducePolicy::Pack::kPooled, bytes_options());

  secondary_ = secondary_shards(groups.secondary, shard_, world_, policy_.units, buckets_.size());
  OptimizerOptions optimizer = options_.optimizer;
  // Stage 0: rank 0 holds every element; hybrid: group 0's ranks do (Note [hybrid sharding]).
  optimizer.owner_ranks = policy_.replicated ? 1 : replicas_ ? shard_.size() : 0;
  optimizer_ =
      std::make_unique<ShardOptimizer>(make_state_store(std::move(master), std::move(state_file)), world_, optimizer);
  if (policy_.replicated) {  // stage 0 reduces each bucket into this scratch shard first
    size_t largest = 0;
    for (Bucket* b : buckets_) largest = std::max(largest, b->layout.shard_numel());
    stage0_scratch_ = at::empty({static_cast<int64_t>(largest)}, f32);
  }
  // Started last, so a constructor that throws never leaves a joinable thread behind. No
  // exception leaves the thread: comm_loop keeps what a reduce throws for step() to
  // rethrow; anything else (a failed lock or wait) is kept the same way and the loop goes
  // on, so step() never waits for a thread that has died.
  comm_thread_ = std::thread([this] {
    for (;;) {
      try {
        comm_loop();
        return;
      }
      ZRT_RETHROW_FORCED_UNWIND catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!comm_error_) comm_error_ = std::current_exception();
      }
    }
  });
}

// One bucket's starting values, one bucket at a time so that no rank ever holds more than
// one bucket in FP32 beside its shards: its parameters are materialized if the model was
// built on the meta device, every rank takes rank 0's FP32 values, this rank keeps its part
// as master, the working copy is cast from them, and the parameters become views of it.
void Engine::fill_bucket(Group& g, Bucket& b, at::Tensor& master, NvmeStateStore* file) {
  if (options_.materialize) {
    std::vector<size_t> pending;
    for (size_t i : b.params) {
      if (g.params[i].is_meta()) pending.push_back(i);
    }
    if (!pending.empty()) {
      std::vector<at::Tensor> real = options_.materialize(b.group, pending);
      ZRT_CHECK(real.size() == pending.size(), "Engine: materialize returned ", real.size(), " tensors for ",
                pending.size(), " parameters");
      for (size_t k = 0; k < pending.size(); ++k) {
        const at::Tensor& t = real[k];
        ZRT_CHECK(t.defined() && t.device() == device_ && t.scalar_type() == at::kFloat &&
                      t.sizes() == g.params[pending[k]].sizes() && t.requires_grad() && t.is_leaf(),
                  "Engine: materialize gave parameter ", pending[k], " of group ", b.group,
                  " a tensor that is not a float32 leaf requiring grad of its shape on ", device_.str());
        g.params[pending[k]] = t;
      }
    }
  }
  const int64_t bn = static_cast<int64_t>(b.layout.padded_numel());
  at::Tensor f = at::zeros({bn}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (size_t j = 0; j < b.params.size(); ++j) {
    const at::Tensor& p = g.params[b.params[j]];
    ZRT_CHECK(!p.is_meta(), "Engine: parameter ", b.params[j], " of group ", b.group,
              " is on the meta device and nothing materializes it");
    f.narrow(0, static_cast<int64_t>(b.layout.param_offset(j)), p.numel()).copy_(p.detach().reshape({-1}));
  }
  constexpr int64_t kPiece = int64_t{1} << 30;  // MPI counts are int: broadcast in pieces
  for (int64_t off = 0; off < bn; off += kPiece) {
    world_.broadcast(f.data_ptr<float>() + off, static_cast<size_t>(std::min(kPiece, bn - off)), DType::kFloat32, 0)
        ->wait();
  }
  const int64_t shard = static_cast<int64_t>(b.layout.shard_numel());
  keep_master(b, g.dtype, policy_.replicated ? f : f.narrow(0, shard_.rank() * shard, shard), master, file);
  const bool whole = units_.gathered(b.index);  // stage-3 units start released
  if (whole) {
    cast_from_f32_on(device_, f.data_ptr<float>(), units_.full(b.index).data_ptr(), g.dtype, static_cast<size_t>(bn));
  }
  units_.set_views(b.index, whole);  // the parameters' own (or materialized) values are freed here
}

Engine::~Engine() {
  try {
    settle_update();  // Note [overlapped step]
  } catch (...) {     // a destructor cannot raise
  }
  try {
    param_gathers_.wait_all();  // nothing may write the working copies once they are freed
  } catch (...) {               // a destructor cannot raise; a failed gather's wait has waited for the rest
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  // Never throws: the comm thread never owns the engine, so it is never the one joining.
  // join returns once the queued reduces and gathers are done (or have failed or timed out).
  if (!comm_thread_.joinable()) return;
  try {
    comm_thread_.join();
  } catch (...) {
    comm_thread_.detach();
  }
}

StepStats Engine::step() {
  return naming_units([&] { return step_unnamed(); });
}

StepStats Engine::step_unnamed() {
  settle_update();  // a step without backward: the last update first (Note [overlapped step])
  StepStats stats;
  stats.loss_scale = optimizer_->loss_scale();
  auto t0 = std::chrono::steady_clock::now();
  const bool reduce = reducing_now();
  try {
    if (reduce) drain();                        // buckets the hooks did not already send
  } catch (const CollectiveMismatchError& e) {  // checked calls (stage 3): say why, when this rank knows
    std::lock_guard<std::mutex> lock(mu_);
    if (saw_backward_) throw;
    throw UsageError(__FILE__, __LINE__,
                     detail::concat("engine.step(): rank ", world_.rank(),
                                    " called step() without a backward pass "
                                    "since its previous step() while another rank was still in backward. Call "
                                    "engine.backward(loss) before every engine.step() on every rank; a rank without "
                                    "data can backpropagate a zero loss (for example loss * 0). ",
                                    e.message()));
  }
  stats.reduce_ms = ms_since(t0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!saw_backward_) ++missed_backward_;
    saw_backward_ = false;
  }
  stats.boundary = next_is_boundary();  // See Note [accumulation boundary]
  ++micro_steps_;
  if (stats.boundary) update(stats);
  return stats;
}

char* Engine::own_chunk(const Bucket& b) const {
  const size_t esize = dtype_size(groups_[b.group]->dtype);
  char* base = static_cast<char*>(units_.full(b.index).data_ptr());
  return policy_.replicated ? base : base + static_cast<size_t>(shard_.rank()) * b.layout.shard_numel() * esize;
}

std::vector<Engine::Bucket*> Engine::whole_buckets() const {
  // Buckets whose working copy is held: all of them at stages 0-2; at stage 3 the
  // persistent ones and units held by hold_gathered (after drain, none is in flight).
  std::vector<Bucket*> out;
  for (Bucket* b : buckets_) {
    if (units_.gathered(b->index)) out.push_back(b);
  }
  return out;
}

}  // namespace zerort
