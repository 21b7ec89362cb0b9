// Engine, the update at an accumulation boundary: the optimizer step over every bucket's
// shard, AdamW's low-precision output into the working copies (or stage 3's shard copies), and
// the all-gathers that make each held bucket whole again (the rest of the Engine is engine.cpp,
// engine_reduce.cpp, engine_units.cpp and engine_state.cpp).
#include <chrono>
#include <memory>
#include <vector>

#include "comm/int8_blocks.h"
#include "core/error.h"
#include "optim/cast.h"
#include "runtime/engine_parts.h"
#include "runtime/int8_gather.h"

namespace zerort {

void Engine::update(StepStats& stats) {
  param_gathers_.wait_all();             // the last update's gathers read the chunks this one writes
  if (secondary_) secondary_->forget();  // the weights change (Note [secondary shards])
  ++global_step_;
  std::vector<OutputSegment> outputs;  // AdamW writes the new low-precision shard there
  std::vector<Bucket*> refill;         // stage 3: units held gathered through the step, with a shard copy
  for (Bucket* b : buckets_) {         // the shard copy where there is one (See Note [state tiers])
    const DType dtype = groups_[b->group]->dtype;
    OutputSegment seg{b->opt_offset, b->opt_numel, nullptr, dtype};
    const bool copied = shard_copies_.has(b->index);
    if (copied) {
      seg.open = [this, b] { return shard_copies_.begin_write(b->index); };
      seg.close = [this, b] { shard_copies_.end_write(b->index); };
      if (units_.gathered(b->index)) refill.push_back(b);
    } else if (units_.gathered(b->index)) {
      seg.out = own_chunk(*b);
      if (!policy_.replicated) seg.close = [this, b] { start_param_gather(*b); };
    } else {
      continue;
    }
    // kHost writes the device's memory through host_out_; a shard copy in host memory directly.
    if (host_mover_ && !(copied && shard_copies_.on_host())) lend_host_output(seg, b->opt_numel * dtype_size(dtype));
    outputs.push_back(std::move(seg));
  }
  struct NextWindow {  // hybrid: the next window sums afresh, whatever happens here
    Engine& e;
    ~NextWindow() { e.restart_window_sums(); }
  } next_window{*this};
  const int64_t missed = missed_backward_;
  missed_backward_ = 0;
  bool applied;
  try {
    applied = optimizer_->step(outputs, stats, missed);
  } catch (const UsageError&) {
    micro_steps_ -= options_.optimizer.gradient_accumulation_steps;  // the window is dropped whole
    --global_step_;
    throw;
  }
  if (!applied) {
    ++skipped_steps_;
    return;
  }
  if (policy_.replicated) return;  // every rank updated all of its weights itself
  auto t1 = std::chrono::steady_clock::now();
  for (Bucket* b : refill) {
    fill_own_chunk(*b);
    start_param_gather(*b);
  }
  if (!overlaps_param_gather()) param_gathers_.wait_all();
  stats.gather_ms = ms_since(t1);
}

void Engine::start_param_gather(Bucket& b) {
  if (local_only()) return;  // the update wrote the whole working copy: Note [W = 1 is local]
  param_gathers_.start(b.index, gather_working_copy(b), overlaps_param_gather());
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
