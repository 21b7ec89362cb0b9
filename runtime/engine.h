// Engine: ZeRO stages 0-3 over a list of LibTorch parameters, without Python.
//
//   Engine engine(params, comm, options);       // params become views of one flat bf16/f16 buffer
//   for each micro-batch:
//     engine.begin_backward();                  // before every backward pass
//     (loss * engine.loss_scale()).backward();  // grads land in the flat low-precision grad buffer
//     StepStats s = engine.step();              // reduce; at the accumulation boundary, update
//
// Gradients are averaged over ranks and micro-steps: do not divide the loss by either.
// Several backward passes per micro-step add up, as in PyTorch: begin_backward() finishes
// the reduces the previous pass started before the next one writes gradients. Every rank
// must run at least one backward pass per micro-step; the step() that ends the
// accumulation window throws UsageError on every rank, naming the ranks that did not.
//
// Stage 0 keeps the whole FP32 state on every rank (DDP); stage 1 shards it and reduces
// once per accumulation boundary; stage 2 also reduces every micro-step into the FP32
// gradient shard. Optional fp32_params (FP32 modules such as LayerNorm) form a second flat
// group kept and computed in FP32; both groups share one optimizer and one decision.
//
// Parameters are laid out in buckets of about reduce_bucket_numel elements, in reverse
// order (the order backward produces gradients); each bucket is split into W shards of its
// own. Call grad_ready(group, i) when parameter i's gradient is complete (a
// post-accumulate-grad hook does this from Python): a full bucket is then reduce-scattered
// on the engine's comm thread while backward goes on. step() reduces whatever is left.
//
// Stage 3 keeps only shards. Its buckets are the units the caller plans (UnitSpec): each
// unit's low-precision copy is cast from this rank's FP32 master and all-gathered on the
// comm thread when the caller asks (gather / prefetch, from module hooks), and its memory
// is returned by release() (See Note [released storage], runtime/unit_cache.h).
// A unit whose gradients are all reported is reduce-scattered on the comm thread and
// released. Persistent units (small, shared or root parameters) stay gathered.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <array>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/staged_communicator.h"
#include "core/error.h"
#include "optim/adamw.h"
#include "partition/shard_layout.h"
#include "runtime/compute_stream.h"
#include "runtime/grad_packer.h"
#include "runtime/loss_scaler.h"
#include "runtime/nvme_state_store.h"
#include "runtime/param_gathers.h"
#include "runtime/reduce_policy.h"
#include "runtime/shard_copies.h"
#include "runtime/secondary_shards.h"
#include "runtime/shard_groups.h"
#include "runtime/shard_optimizer.h"
#include "runtime/step_overlap.h"
#include "runtime/unit_cache.h"
#include "runtime/unit_names.h"

namespace zerort {

// Elements: each shard of an Engine's buckets is a multiple of this by default. The one
// definition: Python reads it as zerort._C.SHARD_ALIGNMENT (memory estimates, shard map).
inline constexpr size_t kShardAlignment = 16;

struct EngineOptions {
  int stage = 2;  // 0, 1, 2 or 3
  // optimizer.precision is the compute precision of `params` (bf16, f16 or f32); its adamw
  // is every parameter's until optimizer().set_hyper_groups (param groups). The Engine sets
  // optimizer.replicated itself (stage 0).
  OptimizerOptions optimizer;
  // Optional, for a model built on the meta device: real tensors (float32 leaves that
  // require grad, on the engine's device, initialized) for these parameters of a group.
  // Called bucket by bucket, so at most about one bucket exists in FP32 at a time.
  std::function<std::vector<at::Tensor>(size_t group, const std::vector<size_t>& params)> materialize;
  size_t reduce_bucket_numel = size_t{1} << 24;  // gradient elements (all ranks) per bucket
  size_t alignment = kShardAlignment;            // elements; each shard is a multiple of it
  // Where the FP32 master, m and v live: See Note [state tiers] (engine_tiers.cpp). kHost: in
  // host memory, with the FP32 gradient, beside a model on a device; kNvme: in a file under
  // nvme.directory (nvme.rank is taken from the communicator). gradient_on_device (kHost, kNvme;
  // not with nvme.gradient_in_file): the FP32 gradient stays on the model's device, copied down
  // in pieces of nvme.chunk_elements (Note [gradient on the device], device_gradient_store.h).
  StateTier state_tier = StateTier::kMemory;
  NvmeStateOptions nvme;
  bool gradient_on_device = false;
  // Stage 3 with the state in kNvme: a directory for the released units' low-precision shards
  // (offload_param nvme; the I/O's shape is nvme's); empty keeps them in memory (Note [state tiers]).
  std::string param_nvme_path;
  // Stage 3 with the state in kHost: the released units' low-precision shards in (pinned) host
  // memory, copied to the device by each gather (offload_param cpu for a model on a device).
  bool param_host = false;
  // Stages 1-2: step() returns with each bucket's parameter all-gather in flight, wait_param_gather(b)
  // waits for one (Note [overlapped parameter gather]); stages 0 and 3 gather nothing then.
  bool overlap_param_gather = false;
  // Stage 3: each gather of a low-precision unit (W > 1) carries int8 blocks, decoded into every
  // rank's chunk, its own too (stage3.gather_dtype int8, DeepSpeed's zero_quantized_weights):
  // See Note [int8 blocks]. The FP32 master is never quantized. CPU models only.
  bool gather_int8 = false;
  // Stages 1-3 with the state off memory (kHost, kNvme): step() decides and returns while a worker
  // updates the units in the next forward's order: See Note [overlapped step] (step_overlap.h).
  bool overlap_step = false;
};

// Stage 3: one unit of `params` (indices into it), gathered and released as one. A
// persistent unit is gathered once and kept (parameters too small or too shared to shard
// by use). The units of a stage-3 engine cover every parameter exactly once. name: what
// errors call the unit (See Note [unit names]); empty for none.
struct UnitSpec {
  UnitSpec(std::vector<size_t> params = {}, bool persistent = false, std::string name = {})
      : params(std::move(params)), persistent(persistent), name(std::move(name)) {}
  std::vector<size_t> params;
  bool persistent;
  std::string name;
};

class Engine {
 public:
  // params, fp32_params: defined float32 leaf tensors that require grad, all on one device
  // (CPU, or CUDA with a communicator of device memory: nccl, or mpi/gloo staged); the same lists, shapes and order on every rank.
  // Rank 0's values are broadcast. Errors name the index. Buffers live on that device.
  // units: stage 3 only, required there (fp32_params form persistent buckets of their own).
  // groups: hybrid sharding over parts of comm (Note [hybrid sharding]); the default shards
  // over the whole of comm. Stages 1-3, state in memory, host backends.
  Engine(std::vector<at::Tensor> params, Communicator& comm, EngineOptions options,
         std::vector<at::Tensor> fp32_params = {}, std::vector<UnitSpec> units = {}, ShardGroups groups = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // torch's current stream at forward, backward and step (its packed c10::Stream and handle),
  // which the engine's device work follows and leads: Note [stream order] (comm/stream_order.h).
  void set_compute_stream(int64_t stream_id, int device_index, int device_type, uintptr_t cuda_stream);
  bool local_only() const;  // Note [W = 1 is local] (engine_local.cpp)

  double loss_scale() const { return optimizer_->loss_scale(); }
  double grad_denominator() const { return optimizer_->grad_denominator(); }  // See ShardOptimizer
  StepStats step();

  int64_t global_step() const { return global_step_; }  // boundaries passed
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t adam_steps() const { return optimizer_->adam_steps(); }
  ShardOptimizer& optimizer() { return *optimizer_; }  // non-finite diagnostics (python/zerort/engine/nonfinite.py)
  const EngineOptions& options() const { return options_; }
  const c10::Device& device() const { return device_; }  // the model's: CPU or CUDA
  // Note [accumulation boundary]: micro-steps count every step() since the start (a loaded
  // checkpoint sets the count); the window is gradient_accumulation_steps of them, and the
  // step() that ends it updates. micro_step_in_window() is the micro-steps already in the
  // open window (0 at its start); next_is_boundary() whether the next step() ends it. The
  // one place this rule lives: Python asks these (engine.is_gradient_accumulation_boundary).
  int64_t micro_step_in_window() const { return micro_steps_ % options_.optimizer.gradient_accumulation_steps; }
  bool next_is_boundary() const { return micro_step_in_window() + 1 == options_.optimizer.gradient_accumulation_steps; }

  // Backward hook entry: parameter i of group g (0: params, 1: fp32_params) has its full
  // gradient for this micro-step. Thread-safe; returns quickly.
  void grad_ready(size_t group, size_t param);
  // Before each backward pass (the Python engine's backward() calls it): waits for the
  // reduces a previous pass of this micro-step started, so the next pass adds to what is
  // left instead of racing with them.
  void begin_backward();
  // Reduces what this micro-step's backward passes left now (a collective on every rank),
  // so grad() holds the accumulation window's gradients so far: for deepspeed.utils'
  // safe_get_full_grad. Stages 0 and 1 reduce in the window's last micro-step only: a
  // UsageError before it.
  void reduce_now();

  // Stages 1-2 with overlap_param_gather (Note [overlapped parameter gather]): bucket b's
  // working copy is whole once wait_param_gather(b) returns, every one once
  // wait_param_gathers() does (no-ops for a bucket whose gather is done). bucket_of: the
  // bucket (index into every group's buckets) holding parameter i of group g.
  void wait_param_gather(size_t bucket);
  void wait_param_gathers();
  std::vector<size_t> param_gathers_in_flight() const { return param_gathers_.in_flight(); }
  size_t bucket_of(size_t group, size_t param) const;
  bool overlaps_param_gather() const;  // the option, at a stage it applies to
  // Note [overlapped step] (runtime/step_overlap.h): whether step() leaves the update running;
  // the order its units are updated in (buckets, the next forward's; stage 3's Python sets the
  // recorded unit order); what the last update's waits cost; a test hook.
  bool overlaps_step() const;
  void set_update_order(std::vector<size_t> buckets);
  std::vector<size_t> update_order() const;
  OverlapReport overlap_report() const { return step_overlap_.report(); }
  void hold_last_update(bool hold) { step_overlap_.hold_last_unit(hold); }
  // The update done, its gathers issued: before a collective from outside the engine (Note).
  void finish_update() { settle_update(); }
  // The ranks that share one copy of the state: the world, or a hybrid group (Note [hybrid
  // sharding]) and this rank's index in it.
  int shard_size() const { return shard_.size(); }
  int shard_rank() const { return shard_.rank(); }

  // Stage 3 (bucket b is unit b of the constructor's units; fp32 buckets follow).
  size_t num_buckets() const { return buckets_.size(); }
  void prefetch(size_t bucket);  // start gathering b on the comm thread, if it is not
  void gather(size_t bucket);    // b is whole when this returns: its parameters view it
  void release(size_t bucket);   // return b's memory (not persistent, not held)
  // While held (a counter), nothing is released. The last hold_gathered(false) hands the
  // gathered storage off: Note [handed-off storage] (engine_units.cpp).
  void hold_gathered(bool hold);
  size_t gathered_bytes() const;  // working memory of non-persistent units now held
  size_t gathered_peak() const;   // ... and the most at once since the last reset
  void reset_gathered_peak();

  // Group 0 holds `params` (compute precision), group 1 `fp32_params` when there are any.
  struct Group;
  struct Bucket;
  size_t num_groups() const { return groups_.size(); }
  size_t numel(size_t group = 0) const;                   // parameter elements (no padding)
  size_t param_offset(size_t group, size_t param) const;  // in the group's flat buffers
  const at::Tensor& flat_params(size_t group = 0) const;  // padded, the group's dtype (undefined at stage 3)
  const at::Tensor& flat_grads(size_t group = 0) const;   // stages 0, 1 (undefined at stage 2)
  // This rank's FP32 state for the group: its shards (stages 1, 2) or all of it (stage 0).
  // The tensors themselves, in memory: a UsageError for any other tier (use read_state).
  at::Tensor master(size_t group = 0) const;
  at::Tensor exp_avg(size_t group = 0) const;
  at::Tensor exp_avg_sq(size_t group = 0) const;
  // This rank's FP32 gradient for the group, laid out as master(): summed over ranks, still
  // multiplied by the loss scale and the window length (step() divides); see reduce_now().
  at::Tensor grad(size_t group = 0) const;
  // The group's whole FP32 master in flat_params order, on every rank (a collective).
  at::Tensor gather_master(size_t group = 0) const;
  // Elements [offset, offset + n) of one array of this rank's optimizer state, in any tier:
  // a new CPU tensor (float32 master; m and v in the state dtype). Offsets
  // run across the groups, group g's from its first bucket's opt_offset (bucket_layout).
  at::Tensor read_state(StateArray array, size_t offset, size_t n) const;
  // values (1-D, the array's dtype) into elements [offset, offset + values.numel()).
  void write_state(StateArray array, size_t offset, const at::Tensor& values);
  StateTierStats state_tier_stats() const;
  StateTierStats param_tier_stats() const { return shard_copies_.stats(); }  // the shard copies' file
  // Checkpoints. The optimizer tensors are master()/exp_avg()/exp_avg_sq() (write into
  // them to load); these are the rest of the state, and refresh_params() rebuilds every
  // rank's working weights from the master afterwards (a collective).
  struct Counters {
    int64_t global_step, skipped_steps, micro_steps, adam_steps;
    LossScaler::State scaler;
  };
  Counters counters() const;
  void load_counters(const Counters& c);
  void refresh_params();
  // (flat_offset, padded_numel, shard_numel, opt_offset) of each bucket of the group.
  std::vector<std::array<size_t, 4>> bucket_layout(size_t group) const;

  // For the memory report: the FP32 gradient (every group; with the gradient in the NVMe
  // file, the reduce scratch that stands in for it; kHost's, beside it), stage 0's reduce scratch,
  // the gradient pack buffers (stage 2's two, plus the largest one-off buffer; stage 3's
  // per-unit ones) and the low-precision parameters held for good (stages 0-2: the flat
  // buffers; stage 3: the persistent units, and the shard copies of Note [state tiers] in memory).
  size_t grad_shard_bytes() const;
  const at::Tensor& stage0_scratch() const { return stage0_scratch_; }
  size_t pack_buffer_bytes() const;
  size_t resident_param_bytes() const;

 private:
  const Group& group(size_t g) const;
  // Its grads -> the FP32 gradient (accumulating); true when the reduce is left in flight
  // (Note [reduces in flight], engine_reduce.cpp).
  bool reduce_bucket(Bucket& b);
  void reduce_bucket_into(Bucket& b, float* grad);  // ... at grad, on device_ (this rank's piece), waited for
  // Stages 1-3: b's reduce into grad issued (nullptr: nothing to wait for); a packed bucket
  // keeps its buffer until end_reduce, which waits for it and gives the buffer back.
  WorkPtr start_reduce(Bucket& b, float* grad);
  void end_reduce(size_t bucket, const WorkPtr& work);
  void settle_reduces(size_t keep);  // comm thread: waits the oldest in flight until `keep` are left
  void drain();                      // queue every bucket not reduced yet; wait for all
  void finish_round();               // drain() when a backward pass of this micro-step started reducing
  void start_gather_locked(Bucket& b);
  void release_locked(std::unique_lock<std::mutex>& lock, Bucket& b, bool hand_off = false);
  void gather_on_comm_thread(Bucket& b);
  // Starting values (constructor), this rank's FP32 part kept by keep_master.
  void fill_bucket(Group& g, Bucket& b, at::Tensor& master, NvmeStateStore* file);
  Bucket& unit(size_t index, const char* what);  // bucket `index`, checked, at stage 3
  void wait_gathered_locked(std::unique_lock<std::mutex>& lock, Bucket& b);
  void enqueue_ready_locked();
  void comm_loop();
  // The queue's next op, and (W = 1) the whole queue on this thread; mu_ held.
  void run_next_locked(std::unique_lock<std::mutex>& lock);
  void run_here_locked(std::unique_lock<std::mutex>& lock);
  bool reducing_now() const;                // does this micro-step reduce (stage 2, or a boundary)?
  at::TensorOptions bytes_options() const;  // uint8 on the model's device
  // grad_ready's steps (mu_ held): the first report of (g, i) in this round, else a
  // UsageError; the gradient moved where the policy keeps it until the reduce.
  void report_locked(size_t g, size_t i);
  void take_gradient_locked(Bucket& b, size_t param);
  void pack_locked(Bucket& b, size_t param);  // param's grad into b's pack buffer; frees it
  StepStats step_unnamed();                   // step() before Note [unit names]
  void update(StepStats& stats);
  void settle_update() const { step_overlap_.finish(); }  // See Note [overlapped step]
  // The overlapped update of `outputs` (built by update()); `collective`: stage 3's gathered
  // units, whose gathers step() issues itself once their update is done.
  void start_overlapped_update(std::vector<OutputSegment> outputs, const std::vector<Bucket*>& in_outputs,
                               const std::vector<Bucket*>& collective);
  // f(), its zerort::Error naming the units behind the tags it lists: See Note [unit names].
  template <typename F>
  auto naming_units(F&& f) -> decltype(f());
  char* own_chunk(const Bucket& b) const;      // this rank's part of b's working copy
  std::vector<Bucket*> whole_buckets() const;  // buckets whose working copy is held
  at::Tensor optimizer_slice(const at::Tensor& t, size_t group) const;
  // The tier's files made on every rank (the state's, returned: nullptr in memory; the shard
  // copies', into shard_copies_), or a ConfigError on every rank naming each rank's failure,
  // before any state is written. See Note [state tiers].
  std::unique_ptr<NvmeStateStore> open_tier_files(size_t numel);
  void make_shard_copies();  // open_tier_files' second file (or the copies in memory)
  // The in-memory master's dtype: f32, or bf16 (options_.optimizer.master_dtype, checked
  // against what a bf16 master works with; Note [bf16 master]).
  at::ScalarType master_type() const;
  void make_reduce_scratch();  // reduce_scratch_: the largest bucket's shard, on the device
  void open_host_tier();       // kHost: the mover, its buffers and the shard copies on the device
  void open_mover();           // the tiers off memory: host_mover_ and host_out_ (See Note [state tiers])
  // Bucket b's starting FP32 part `mine` into master (in memory) or the file, with the shard
  // copy the file's tier needs (See Note [state tiers]).
  void keep_master(Bucket& b, DType dtype, const at::Tensor& mine, at::Tensor& master, NvmeStateStore* file);
  // The state store: master in memory, or the file that keep_master filled.
  std::unique_ptr<OptimizerStateStore> make_state_store(at::Tensor master, std::unique_ptr<NvmeStateStore> file);
  // Master elements [offset, offset + n), cast to dtype at out (on device_; in host memory when
  // out_on_host, kHost's only), from any tier.
  void cast_master(size_t offset, size_t n, void* out, DType dtype, bool out_on_host = false) const;
  // kHost: seg's destination is device memory, so AdamW writes it into host_out_ and close()
  // copies it over before seg's own close() (See Note [state tiers]).
  void lend_host_output(OutputSegment& seg, size_t bytes);
  void start_param_gather(Bucket& b);  // its updated chunk to every rank: Note [overlapped parameter gather]
  // b's working copy whole from every rank's chunk (this rank's filled): the one all-gather of
  // parameters, plain or of int8 blocks (gather_int8), decoded when the Work is waited for.
  WorkPtr gather_working_copy(Bucket& b);
  void fill_own_chunk(const Bucket& b);  // this rank's chunk of b's working copy, from its shard
  // Hybrid, in the window's last micro-step (comm thread): b's gradient from this reduce on
  // summed across the groups, once per window, later reduces as summed increments (Note
  // [hybrid sharding]). grad: b's part of the FP32 gradient.
  void reduce_bucket_across_groups(Bucket& b, float* grad);
  void restart_window_sums();  // the gradient starts a new window: no bucket is summed across groups

  Communicator& world_;     // every rank: the step's decision, rank 0's starting values
  Communicator& shard_;     // the ranks that shard the state: world_, or the group (Note [hybrid sharding])
  Communicator* replicas_;  // hybrid: the other groups' ranks of this index; else nullptr
  InterNodeWire replica_wire_;
  EngineOptions options_;
  ReducePolicy policy_;  // the stage's meaning, decided once: See Note [reduce policy]
  c10::Device device_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<Bucket*> buckets_;               // every group's buckets, in reduce order
  std::unique_ptr<ShardOptimizer> optimizer_;  // this rank's FP32 master, m, v, gradient
  ShardCopies shard_copies_;                   // stage 3 off memory: See Note [state tiers]
  // kHost: the copies between the device and the host state, and what they go through: the
  // reduces' FP32 target on the device (comm thread) and the step's host output (main thread).
  // reduce_scratch_ is also the reduces' target when the gradient is in the NVMe file.
  std::unique_ptr<Mover> host_mover_;
  at::Tensor reduce_scratch_;
  std::shared_ptr<char> host_out_;
  std::shared_ptr<char> reduce_host_;   // gradient_in_file: the reduce's gradient in host memory
  at::Tensor stage0_scratch_;           // stage 0: one bucket's reduced shard, FP32
  UnitCache units_;                     // every bucket's working copy (unit b is bucket b): See Note [unit cache]
  std::unique_ptr<GradPacker> packer_;  // mu_ held; See Note [grad packer]
  ParamGathers param_gathers_;          // stages 0-2's after an update: Note [overlapped parameter gather]
  std::unique_ptr<SecondaryShards> secondary_;  // stage 3, hpZ: Note [secondary shards]; else nullptr
  mutable StepOverlap step_overlap_;            // Note [overlapped step]
  std::vector<size_t> update_order_;            // set_update_order's; empty: the default
  int64_t micro_steps_ = 0, global_step_ = 0, skipped_steps_ = 0;
  bool saw_backward_ = false;    // a backward pass ran in this micro-step
  int64_t missed_backward_ = 0;  // micro-steps of this window without one

  // The comm thread and its queue of work: reduce or (stage 3) gather a bucket (an index
  // into buckets_). Every collective is issued from that queue, in the order queued.
  enum class Op { kReduce, kGather };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<Op, size_t>> queue_;
  bool busy_ = false;         // the comm thread is running an op
  size_t next_to_queue_ = 0;  // buckets are queued strictly in order, on every rank alike
  size_t next_to_issue_ = 0;  // stages 0-2: the bucket whose reduce the comm thread takes next
  size_t reduced_ = 0;        // buckets the comm thread finished this round
  // Reduces issued and not waited for yet, oldest first, with their buckets; the comm thread's
  // alone (read under mu_). See Note [reduces in flight].
  std::deque<std::pair<WorkPtr, size_t>> in_flight_;
  bool round_open_ = false;  // a backward pass of this micro-step started reducing
  // Per group: parameters whose gradient this round already reported (a second report
  // means a backward pass that did not go through begin_backward()).
  std::vector<std::vector<bool>> reported_;
  bool stop_ = false;
  std::optional<c10::Stream> compute_stream_;  // set_compute_stream's (mu_): Note [stream order]
  std::exception_ptr comm_error_;
  std::thread comm_thread_;
};

template <typename F>
auto Engine::naming_units(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    const std::string more = unit_names_suffix(e.what(), units_);  // names are fixed: no lock
    if (more.empty()) throw;
    rethrow_with(more);
  }
}

}  // namespace zerort
