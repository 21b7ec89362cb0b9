#include "comm/staged_communicator.h"

#include <cstring>
#include <iterator>
#include <mutex>
#include <unordered_map>

#include "comm/local_reduce.h"
#include "core/error.h"

namespace zerort {

namespace {

class HostMover final : public Mover {
 public:
  std::shared_ptr<char> host_buffer(size_t bytes) override {
    return std::shared_ptr<char>(new char[bytes == 0 ? 1 : bytes], std::default_delete<char[]>());
  }
  void to_host(void* host, const void* buf, size_t bytes) override { copy(host, buf, bytes); }
  void from_host(void* buf, const void* host, size_t bytes) override { copy(buf, host, bytes); }
  bool device_memory() const override { return false; }
  const char* name() const override { return "host"; }

 private:
  static void copy(void* dst, const void* src, size_t bytes) {
    if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
  }
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(std::shared_ptr<Communicator> inner, std::unique_ptr<Mover> mover, CommOptions options)
      : Communicator(inner->rank(), inner->size(), options), inner_(std::move(inner)), mover_(std::move(mover)),
        name_(std::string(inner_->backend_name()) + "+staged-" + mover_->name()) {}

  const char* backend_name() const override { return name_.c_str(); }
  bool device_memory() const override { return mover_->device_memory(); }

 protected:
  WorkPtr do_all_reduce(void* buf, const CollectiveDesc& d) override {
    auto h = stage_in(buf, bytes(d, d.count));
    return back(inner_->all_reduce(h.get(), d.count, d.dtype, d.op, d.tag), h, buf, bytes(d, d.count));
  }
  WorkPtr do_reduce_scatter(const void* in, void* out, const CollectiveDesc& d) override {
    auto h_in = stage_in(in, bytes(d, d.count * world()));
    auto h_out = mover_->host_buffer(bytes(d, d.count));
    WorkPtr w = inner_->reduce_scatter(h_in.get(), h_out.get(), d.count, d.dtype, d.op);
    w->keep_alive(h_in);
    return back(w, h_out, out, bytes(d, d.count));
  }
  WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) override {
    auto h_in = stage_in(in, bytes(d, d.count));
    auto h_out = mover_->host_buffer(bytes(d, d.count * world()));
    WorkPtr w = inner_->all_gather(h_in.get(), h_out.get(), d.count, d.dtype, d.tag);
    w->keep_alive(h_in);
    return back(w, h_out, out, bytes(d, d.count * world()));
  }
  WorkPtr do_all_to_all(const void* in, void* out, const CollectiveDesc& d) override {
    auto h_in = stage_in(in, bytes(d, d.count * world()));
    auto h_out = mover_->host_buffer(bytes(d, d.count * world()));
    WorkPtr w = inner_->all_to_all(h_in.get(), h_out.get(), d.count, d.dtype);
    w->keep_alive(h_in);
    return back(w, h_out, out, bytes(d, d.count * world()));
  }
  WorkPtr do_broadcast(void* buf, const CollectiveDesc& d) override {
    auto h = stage_in(buf, bytes(d, d.count));
    return back(inner_->broadcast(h.get(), d.count, d.dtype, d.root), h, buf, bytes(d, d.count));
  }
  WorkPtr do_barrier(const CollectiveDesc&) override { return inner_->barrier(); }
  // The W received chunks and the FP32 sum stay on the host; the FP32 shard goes back.
  // accumulate: Note [staged accumulate] in comm/staged_communicator.h.
  WorkPtr do_reduce_scatter_accumulate(const void* in, float* out, bool accumulate, const CollectiveDesc& d) override {
    auto h_in = stage_in(in, bytes(d, d.count * world()));
    const size_t out_bytes = d.count * sizeof(float);
    if (accumulate) settle_pending(out);
    auto h_sum = accumulate ? stage_in(out, out_bytes) : mover_->host_buffer(out_bytes);
    WorkPtr w = inner_->reduce_scatter_accumulate(h_in.get(), d.dtype, reinterpret_cast<float*>(h_sum.get()), d.count,
                                                  accumulate, d.tag);
    w->keep_alive(h_in);
    back(w, h_sum, out, out_bytes);
    remember_pending(out, w);
    return w;
  }
  // The reduce scratch is the inner communicator's (the staging buffers are not counted).
  size_t scratch_peak_bytes() const override { return inner_->scratch_peak_bytes(); }
  void reset_scratch_peak() override { inner_->reset_scratch_peak(); }
  WorkPtr local_copy(const void* in, void* out, const CollectiveDesc& d) override {
    const size_t n = bytes(d, d.count);
    if (in == out || n == 0) return Communicator::local_copy(in, out, d);
    auto h = stage_in(in, n);
    mover_->from_host(out, h.get(), n);
    return Communicator::local_copy(out, out, d);  // done: nothing left to move
  }
  WorkPtr local_reduce_scatter_accumulate(const void* in, float* out, bool accumulate,
                                          const CollectiveDesc& d) override {
    auto h_in = stage_in(in, bytes(d, d.count));  // done at once: out is read now, as it is used
    auto h_out = accumulate ? stage_in(out, d.count * sizeof(float)) : mover_->host_buffer(d.count * sizeof(float));
    sum_chunks_to_f32(h_in.get(), d.dtype, 1, d.count, reinterpret_cast<float*>(h_out.get()), accumulate);
    mover_->from_host(out, h_out.get(), d.count * sizeof(float));
    return Communicator::local_copy(out, out, d);
  }

 private:
  size_t world() const { return static_cast<size_t>(size()); }
  static size_t bytes(const CollectiveDesc& d, size_t elements) { return elements * dtype_size(d.dtype); }
  std::shared_ptr<char> stage_in(const void* buf, size_t n) {
    auto h = mover_->host_buffer(n);
    mover_->to_host(h.get(), buf, n);
    return h;
  }
  // The inner collective's result goes back to the caller's buffer on the waiting thread.
  WorkPtr back(WorkPtr w, std::shared_ptr<char> host, void* buf, size_t n) {
    w->keep_alive(host);
    std::shared_ptr<Mover> mover = mover_;
    w->then([mover, host, buf, n] { mover->from_host(buf, host.get(), n); });
    return w;
  }

  // An earlier reduce_scatter_accumulate into `out` still in flight is finished first, so its
  // sum is in `out` when this call stages it (Note [staged accumulate]).
  void settle_pending(const float* out) {
    WorkPtr earlier;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      auto it = pending_.find(out);
      if (it != pending_.end()) earlier = it->second.lock();
    }
    if (earlier) earlier->wait();
  }
  void remember_pending(const float* out, const WorkPtr& w) {
    std::lock_guard<std::mutex> lock(pending_mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {  // the finished ones' Works are gone
      it = it->second.expired() ? pending_.erase(it) : std::next(it);
    }
    pending_[out] = w;
  }

  std::shared_ptr<Communicator> inner_;
  std::shared_ptr<Mover> mover_;
  std::mutex pending_mu_;
  std::unordered_map<const float*, std::weak_ptr<Work>> pending_;
  std::string name_;
};

}  // namespace

std::unique_ptr<Mover> make_host_mover() { return std::make_unique<HostMover>(); }

std::unique_ptr<Communicator> make_staged_communicator(std::shared_ptr<Communicator> inner,
                                                       std::unique_ptr<Mover> mover, CommOptions options) {
  ZRT_CHECK(inner && mover, "make_staged_communicator: needs a host communicator and a mover");
  ZRT_CHECK(!inner->device_memory(), "make_staged_communicator: '", inner->backend_name(),
            "' already moves device memory; stage only a host backend (mpi or gloo)");
  ZRT_CHECK(!inner->checks_each_call(), "make_staged_communicator: make the inner '", inner->backend_name(),
            "' communicator without comm.debug; the staged one checks every call when asked");
  return std::make_unique<StagedCommunicator>(std::move(inner), std::move(mover), options);
}

}  // namespace zerort
