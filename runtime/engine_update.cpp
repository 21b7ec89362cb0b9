// Engine, the update at an accumulation boundary: the optimizer step over every bucket's
// shard, AdamW's low-precision output into the working copies (or stage 3's shard copies), and
// the all-gathers that make each held bucket whole again (the rest of the Engine is engine.cpp,
// engine_reduce.cpp, engine_units.cpp and engine_state.cpp).
#include <chrono>
#include <deque>
#include <memory>

#include "core/error.h"
#include "runtime/engine_parts.h"

namespace zerort {

void Engine::update(StepStats& stats) {
  ++global_step_;
  std::vector<Bucket*> whole = whole_buckets();
  std::deque<WorkPtr> gathers;         // kHost starts them during the step
  std::vector<OutputSegment> outputs;  // AdamW writes the new low-precision shard there
  for (Bucket* b : buckets_) {         // the shard copy where there is one (See Note [state tiers])
    const DType dtype = groups_[b->group]->dtype;
    OutputSegment seg{b->opt_offset, b->opt_numel, nullptr, dtype};
    const bool copied = shard_copies_.has(b->index);
    if (copied) {
      seg.open = [this, b] { return shard_copies_.begin_write(b->index); };
      seg.close = [this, b] { shard_copies_.end_write(b->index); };
    } else if (units_.gathered(b->index)) {
      seg.out = own_chunk(*b);
    } else {
      continue;
    }
    // kHost writes the device's memory through host_out_; a shard copy in host memory directly.
    if (host_mover_ && !(copied && shard_copies_.on_host())) {
      lend_host_output(seg, b->opt_numel * dtype_size(dtype), copied ? nullptr : b, gathers);
    }
    outputs.push_back(std::move(seg));
  }
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
  for (Bucket* b : whole) {
    const bool copied = shard_copies_.has(b->index);
    if (host_mover_ && !copied) continue;  // started when its output reached the device
    if (copied) fill_own_chunk(*b);        // a unit held gathered through the step
    start_gather_after_update(*b, gathers);
  }
  for (auto& w : gathers) w->wait();
  stats.gather_ms = ms_since(t1);
}

void Engine::start_gather_after_update(Bucket& b, std::deque<WorkPtr>& gathers) {
  // Two in flight at a time: the backend pipelines them, and a staged communicator holds
  // staging buffers for two buckets, not the whole model.
  constexpr size_t kInFlight = 2;
  if (gathers.size() == kInFlight) {
    gathers.front()->wait();
    gathers.pop_front();
  }
  gathers.push_back(comm_.all_gather(own_chunk(b), units_.full(b.index).data_ptr(), b.layout.shard_numel(),
                                     groups_[b.group]->dtype, static_cast<int64_t>(b.index)));
}

void Engine::lend_host_output(OutputSegment& seg, size_t bytes, Bucket* gather_after, std::deque<WorkPtr>& gathers) {
  auto dest = std::make_shared<void*>(seg.out);  // the device memory the values go to
  seg.out = nullptr;
  seg.open = [this, dest, open = std::move(seg.open)] {
    if (open) *dest = open();
    return static_cast<void*>(host_out_.get());
  };
  seg.close = [this, dest, close = std::move(seg.close), bytes, gather_after, &gathers] {
    host_mover_->from_host(*dest, host_out_.get(), bytes);
    if (close) close();
    if (gather_after != nullptr && !policy_.replicated) start_gather_after_update(*gather_after, gathers);
  };
}

}  // namespace zerort
