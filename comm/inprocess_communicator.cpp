#include "comm/inprocess_communicator.h"

#include <cstring>

#include "comm/local_reduce.h"
#include "core/error.h"

namespace zerort {

namespace {

class InProcessWork final : public Work {
 public:
  InProcessWork(const CollectiveDesc& d, std::chrono::milliseconds timeout, std::shared_ptr<InProcessGroup> group,
                std::shared_ptr<InProcessGroup::Op> op)
      : Work(d, timeout), group_(std::move(group)), op_(std::move(op)) {}
  ~InProcessWork() override {
    if (!group_->is_done(op_)) retire_buffers();  // a late peer may still execute into them
  }

 protected:
  bool wait_until(std::chrono::steady_clock::time_point deadline) override {
    try {
      return group_->wait_done(op_, deadline);
    } catch (const Error& e) {
      ZRT_THROW_AS(CommError, desc().to_string(), ": ", e.message());
    }
  }
  void on_timeout() override { group_->abort(desc().to_string() + " timed out waiting for its peers"); }

 private:
  std::shared_ptr<InProcessGroup> group_;
  std::shared_ptr<InProcessGroup::Op> op_;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessGroup> group, int rank, CommOptions options)
      : Communicator(rank, group->world_size(), options), group_(std::move(group)) {}
  const char* backend_name() const override { return "inprocess"; }

 protected:
  WorkPtr do_all_reduce(void* buf, const CollectiveDesc& d) override { return post(buf, buf, d); }
  WorkPtr do_reduce_scatter(const void* in, void* out, const CollectiveDesc& d) override { return post(in, out, d); }
  WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) override { return post(in, out, d); }
  WorkPtr do_all_to_all(const void* in, void* out, const CollectiveDesc& d) override { return post(in, out, d); }
  WorkPtr do_broadcast(void* buf, const CollectiveDesc& d) override { return post(buf, buf, d); }
  WorkPtr do_barrier(const CollectiveDesc& d) override { return post(nullptr, nullptr, d); }

 private:
  WorkPtr post(const void* in, void* out, const CollectiveDesc& d) {
    auto op = group_->post(next_seq_++, rank(), in, out, d);
    return std::make_shared<InProcessWork>(d, options().timeout, group_, std::move(op));
  }

  std::shared_ptr<InProcessGroup> group_;
  uint64_t next_seq_ = 0;
};

// Elements this collective writes on one rank.
size_t out_elems(const CollectiveDesc& d) {
  switch (d.kind) {
    case Collective::kAllGather:
    case Collective::kAllToAll:
    case Collective::kReduceScatterAccumulate:  // the all-to-all half lands W chunks
      return d.count * static_cast<size_t>(d.world);
    case Collective::kBarrier: return 0;
    default: return d.count;
  }
}

}  // namespace

std::shared_ptr<InProcessGroup> InProcessGroup::create(int world_size, CommOptions options) {
  ZRT_CHECK(world_size >= 1, "in-process group needs world_size >= 1, got ", world_size);
  return std::shared_ptr<InProcessGroup>(new InProcessGroup(world_size, options));
}

InProcessGroup::InProcessGroup(int world_size, CommOptions options) : world_(world_size), options_(options) {}

std::unique_ptr<Communicator> InProcessGroup::communicator(int rank) {
  return std::make_unique<InProcessCommunicator>(shared_from_this(), rank, options_);
}

void InProcessGroup::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (abort_reason_.empty()) abort_reason_ = reason;
  cv_.notify_all();
}

std::shared_ptr<InProcessGroup::Op> InProcessGroup::post(uint64_t seq, int rank, const void* in, void* out,
                                                         const CollectiveDesc& desc) {
  std::shared_ptr<Op> op;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ZRT_CHECK(abort_reason_.empty(), desc.to_string(), ": in-process group aborted: ", abort_reason_);
    auto& slot = pending_[seq];
    if (!slot) {
      slot = std::make_shared<Op>();
      slot->slots.resize(static_cast<size_t>(world_));
    }
    op = slot;
    op->slots[static_cast<size_t>(rank)] = Slot{in, out, desc};
    if (++op->arrived < world_) return op;
    pending_.erase(seq);
  }
  // Last to arrive: every other rank is parked in wait_done, so the buffers are stable.
  std::string error;
  try {
    execute(*op);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard<std::mutex> lock(mu_);
  op->error = error;
  op->done = true;
  cv_.notify_all();
  return op;
}

bool InProcessGroup::is_done(const std::shared_ptr<Op>& op) {
  std::lock_guard<std::mutex> lock(mu_);
  return op->done;
}

bool InProcessGroup::wait_done(const std::shared_ptr<Op>& op, std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  bool finished =
      cv_.wait_until(lock, deadline, [&] { return op->done || op->arrived == world_ || !abort_reason_.empty(); });
  if (!finished) return false;
  // Every rank arrived: the last one is copying into our buffers right now. That is a
  // bounded local copy, so wait for it past the deadline rather than free buffers under it.
  if (op->arrived == world_) cv_.wait(lock, [&] { return op->done; });
  ZRT_CHECK(op->done || abort_reason_.empty(), "in-process group aborted: ", abort_reason_);
  ZRT_CHECK(op->error.empty(), op->error);
  return true;
}

void InProcessGroup::execute(Op& op) {
  const CollectiveDesc& d0 = op.slots[0].desc;
  for (const Slot& s : op.slots) {  // the backend sees all arguments, so it checks them itself
    ZRT_CHECK(s.desc.kind == d0.kind && s.desc.count == d0.count && s.desc.dtype == d0.dtype && s.desc.op == d0.op &&
                  s.desc.root == d0.root,
              "in-process collective mismatch: rank 0 called ", d0.to_string(), " but rank ", s.desc.rank, " called ",
              s.desc.to_string());
  }
  const size_t esize = d0.kind == Collective::kBarrier ? 0 : dtype_size(d0.dtype);
  const size_t chunk = d0.count * esize;
  const size_t world = static_cast<size_t>(world_);
  // Nothing moves (a barrier, or count 0, where buffers may be null: memcpy must not see them).
  if (chunk == 0) return;
  // Outputs go to scratch first: in-place calls alias inputs that other ranks still read.
  std::vector<std::vector<char>> results(world);
  for (size_t r = 0; r < world; ++r) results[r].resize(out_elems(d0) * esize);
  auto input = [&](size_t r) { return static_cast<const char*>(op.slots[r].in); };

  switch (d0.kind) {
    case Collective::kAllReduce: {
      std::vector<char> acc(input(0), input(0) + chunk);
      for (size_t r = 1; r < world; ++r) reduce_into(acc.data(), input(r), d0.count, d0.dtype, d0.op);
      for (auto& res : results) res = acc;
      break;
    }
    case Collective::kReduceScatter:
      for (size_t dst = 0; dst < world; ++dst) {
        std::memcpy(results[dst].data(), input(0) + dst * chunk, chunk);
        for (size_t r = 1; r < world; ++r) {
          reduce_into(results[dst].data(), input(r) + dst * chunk, d0.count, d0.dtype, d0.op);
        }
      }
      break;
    case Collective::kAllGather:
      for (size_t r = 0; r < world; ++r) std::memcpy(results[0].data() + r * chunk, input(r), chunk);
      for (size_t dst = 1; dst < world; ++dst) results[dst] = results[0];
      break;
    case Collective::kAllToAll:
    case Collective::kReduceScatterAccumulate:
      for (size_t dst = 0; dst < world; ++dst) {
        for (size_t src = 0; src < world; ++src) {
          std::memcpy(results[dst].data() + src * chunk, input(src) + dst * chunk, chunk);
        }
      }
      break;
    case Collective::kBroadcast: {
      const char* root = input(static_cast<size_t>(d0.root));
      for (auto& res : results) res.assign(root, root + chunk);
      break;
    }
    case Collective::kBarrier: break;
  }
  for (size_t r = 0; r < world; ++r) {
    if (!results[r].empty()) std::memcpy(op.slots[r].out, results[r].data(), results[r].size());
  }
}

}  // namespace zerort
