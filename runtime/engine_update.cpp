// Engine, the update at an accumulation boundary: the optimizer step over every bucket's
// shard, AdamW's low-precision output into the working copies (or stage 3's shard copies), and
// the all-gathers that make each held bucket whole again (the rest of the Engine is engine.cpp,
// engine_reduce.cpp, engine_units.cpp and engine_state.cpp).
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "comm/int8_blocks.h"
#include "core/error.h"
#include "optim/cast.h"
#include "runtime/compute_stream.h"
#include "runtime/engine_parts.h"
#include "runtime/int8_gather.h"

namespace zerort {

void Engine::update(StepStats& stats) {
  wait_param_gathers();                  // the last update whole (Note [overlapped step]), and its gathers,
                                         // which read the chunks this one writes
  if (secondary_) secondary_->forget();  // the weights change (Note [secondary shards])
  ++global_step_;
  const bool overlapped = overlaps_step();
  std::vector<OutputSegment> outputs;  // AdamW writes the new low-precision shard there
  std::vector<Bucket*> in_outputs;     // outputs[k] is bucket in_outputs[k]'s
  std::vector<Bucket*> refill;         // stage 3: units held gathered through the step, with a shard copy
  std::vector<Bucket*> collective;     // overlapped: gathered units, gathered on this thread after their update
  for (Bucket* b : buckets_) {         // the shard copy where there is one (See Note [state tiers])
    const DType dtype = groups_[b->group]->dtype;
    OutputSegment seg{b->opt_offset, b->opt_numel, nullptr, dtype};
    const bool copied = shard_copies_.has(b->index);
    const bool gathered_here = overlapped && policy_.units && units_.gathered(b->index);
    if (copied) {
      seg.open = [this, b] { return shard_copies_.begin_write(b->index); };
      seg.close = [this, b] { shard_copies_.end_write(b->index); };
      if (units_.gathered(b->index)) refill.push_back(b);
    } else if (units_.gathered(b->index)) {
      seg.out = own_chunk(*b);
      if (!policy_.replicated && !gathered_here) seg.close = [this, b] { start_param_gather(*b); };
    } else {
      continue;
    }
    if (gathered_here) collective.push_back(b);
    // Off memory, AdamW writes the model's memory through host_out_; a shard copy in host memory
    // (kHost's, a file's staging) directly.
    if (host_mover_ && !(copied && shard_copies_.host_writes()))
      lend_host_output(seg, b->opt_numel * dtype_size(dtype));
    outputs.push_back(std::move(seg));
    in_outputs.push_back(b);
  }
  struct NextWindow {  // hybrid: the next window sums afresh, whatever happens here
    Engine& e;
    ~NextWindow() { e.restart_window_sums(); }
  } next_window{*this};
  const int64_t missed = missed_backward_;
  missed_backward_ = 0;
  bool applied;
  try {
    applied = optimizer_->decide(outputs, stats, missed);
  } catch (const UsageError&) {
    micro_steps_ -= options_.optimizer.gradient_accumulation_steps;  // the window is dropped whole
    --global_step_;
    throw;
  }
  if (!applied) {
    ++skipped_steps_;
    return;
  }
  auto t0 = std::chrono::steady_clock::now();
  if (overlapped) {
    start_overlapped_update(std::move(outputs), in_outputs, collective);
    for (Bucket* b : collective) step_overlap_.wait(b->index, Waiter::kCaller);
  } else {
    optimizer_->apply(outputs, {});
  }
  stats.optimizer_ms += ms_since(t0);
  if (policy_.replicated) return;  // every rank updated all of its weights itself
  auto t1 = std::chrono::steady_clock::now();
  for (Bucket* b : collective) {      // Note [overlapped step]: their gathers are this thread's
    if (b->opt_numel == 0) continue;  // nothing stepped: no gather, as in the step's own closes
    if (shard_copies_.has(b->index)) fill_own_chunk(*b);
    start_param_gather(*b);
  }
  for (Bucket* b : refill) {
    if (overlapped) continue;  // in `collective`
    fill_own_chunk(*b);
    start_param_gather(*b);
  }
  if (!overlaps_param_gather() && !(overlapped && !policy_.units)) param_gathers_.wait_all();
  stats.gather_ms = ms_since(t1);
}

bool Engine::overlaps_step() const {
  return options_.overlap_step && options_.state_tier != StateTier::kMemory && !policy_.replicated;
}

void Engine::set_update_order(std::vector<size_t> buckets) {
  std::vector<bool> seen(buckets_.size(), false);
  for (size_t b : buckets) {
    ZRT_CHECK(b < buckets_.size() && !seen[b], "Engine.set_update_order: bucket ", b,
              " is named twice or does not "
              "exist (",
              buckets_.size(), " buckets)");
    seen[b] = true;
  }
  update_order_ = std::move(buckets);
}

std::vector<size_t> Engine::update_order() const {
  // The next forward's order: the given one, then the buckets it leaves out; by default
  // stage 3's units in order (its units are planned in forward order), else the reverse of the
  // reduce order (buckets are laid out from the last parameter back).
  std::vector<size_t> order = update_order_;
  std::vector<bool> seen(buckets_.size(), false);
  for (size_t b : order) seen[b] = true;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const size_t b = policy_.units ? k : buckets_.size() - 1 - k;
    if (!seen[b]) order.push_back(b);
  }
  return order;
}

void Engine::start_overlapped_update(std::vector<OutputSegment> outputs, const std::vector<Bucket*>& in_outputs,
                                     const std::vector<Bucket*>& collective) {
  std::vector<size_t> position(buckets_.size(), outputs.size());  // bucket -> its output
  for (size_t k = 0; k < in_outputs.size(); ++k) position[in_outputs[k]->index] = k;
  std::vector<size_t> order;     // outputs, the collective ones first
  std::vector<size_t> done_now;  // buckets with nothing to update
  std::vector<bool> first(buckets_.size(), false);
  for (Bucket* b : collective) first[b->index] = true;
  for (Bucket* b : collective) order.push_back(position[b->index]);
  for (size_t b : update_order()) {
    if (position[b] == outputs.size() || outputs[position[b]].numel == 0) {
      done_now.push_back(b);
    } else if (!first[b]) {
      order.push_back(position[b]);
    }
  }
  for (size_t k = 0; k < outputs.size(); ++k) {  // each unit is done once its values are out
    const size_t bucket = in_outputs[k]->index;
    outputs[k].close = [this, bucket, close = std::move(outputs[k].close)] {
      if (close) close();
      step_overlap_.done(bucket);
    };
  }
  std::optional<c10::Stream> stream;  // apply() zeroes a gradient on the device there (Note [gradient on the device])
  {
    std::lock_guard<std::mutex> lock(mu_);  // set_compute_stream writes it under mu_
    stream = compute_stream_;
  }
  auto job = [this, outputs = std::move(outputs), order = std::move(order), stream] {
    const OnComputeStream on_compute(stream);
    optimizer_->apply(outputs, order);
  };
  step_overlap_.start(buckets_.size(), done_now, std::move(job));
}

void Engine::wait_param_gather(size_t bucket) {
  step_overlap_.wait(bucket);  // the worker starts its gather once its update is done (Note [overlapped step])
  param_gathers_.wait(bucket);
}

void Engine::wait_param_gathers() {
  settle_update();
  param_gathers_.wait_all();
}

void Engine::start_param_gather(Bucket& b) {
  if (local_only()) return;  // the update wrote the whole working copy: Note [W = 1 is local]
  const bool forward_waits = overlaps_step() && !policy_.units;  // Note [overlapped step]: the forward's hooks
  param_gathers_.start(b.index, gather_working_copy(b), overlaps_param_gather() || forward_waits);
}

WorkPtr Engine::gather_working_copy(Bucket& b) {
  const DType dtype = groups_[b.group]->dtype;
  const size_t n = b.layout.shard_numel();
  char* full = static_cast<char*>(units_.full(b.index).data_ptr());
  const auto tag = static_cast<int64_t>(b.index);
  if (!(options_.gather_int8 && policy_.units && is_low_precision(dtype))) {
    return shard_.all_gather(own_chunk(b), full, n, dtype, tag);
  }
  // Note [int8 blocks]: this rank's chunk encoded, every chunk decoded from the wire, on the model's device.
  return gather_int8_blocks(shard_, own_chunk(b), dtype, n, full, tag, device_);
}

bool Engine::overlaps_param_gather() const {
  return options_.overlap_param_gather && !policy_.units && !policy_.replicated;
}

void Engine::lend_host_output(OutputSegment& seg, size_t bytes) {
  auto dest = std::make_shared<void*>(seg.out);  // the device memory the values go to
  seg.out = nullptr;
  seg.open = [this, dest, open = std::move(seg.open)] {
    if (open) *dest = open();
    return static_cast<void*>(host_out_.get());
  };
  seg.close = [this, dest, close = std::move(seg.close), bytes] {
    host_mover_->from_host(*dest, host_out_.get(), bytes);
    if (close) close();
  };
}

}  // namespace zerort
