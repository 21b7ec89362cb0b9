#include "comm/two_hop_communicator.h"

#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/hop_memory.h"
#include "comm/hop_pair.h"
#include "comm/serial_queue.h"
#include "core/error.h"

namespace zerort {

namespace {

// What a call's hop 1 leaves for its hop 2 (in hop 1's memory; hop 2 starts after hop 1 ended).
struct Between {
  std::shared_ptr<char> bytes;
};

std::unique_ptr<HopMemory> hop_memory(int device) {
  if (device < 0) return make_host_hop_memory();
#if ZERORT_WITH_NCCL
  return make_cuda_hop_memory(device);
#else
  ZRT_THROW("make_two_hop_communicator: device ", device,
            " needs a build with CUDA (nvcc was not found at build time)");
#endif
}

// See Note [two hops].
class TwoHopCommunicator final : public Communicator {
 public:
  TwoHopCommunicator(std::shared_ptr<Communicator> flat, std::shared_ptr<Communicator> intra,
                     std::shared_ptr<Communicator> inter, InterNodeWire wire, int device, CommOptions options)
      : Communicator(flat->rank(), flat->size(), options), flat_(std::move(flat)), intra_(std::move(intra)),
        inter_(std::move(inter)), wire_(wire), per_node_(static_cast<size_t>(intra_->size())),
        nodes_(static_cast<size_t>(inter_->size())), name_(std::string(flat_->backend_name()) + "+two-hop"),
        intra_mem_(hop_memory(device)), inter_mem_(hop_memory(device)) {}

  const Communicator& flat() const { return *flat_; }
  bool device_memory() const override { return flat_->device_memory(); }

  const char* backend_name() const override { return name_.c_str(); }

 protected:
  WorkPtr do_all_reduce(void* buf, const CollectiveDesc& d) override {
    return flat_->all_reduce(buf, d.count, d.dtype, d.op, d.tag);
  }
  WorkPtr do_reduce_scatter(const void* in, void* out, const CollectiveDesc& d) override {
    return flat_->reduce_scatter(in, out, d.count, d.dtype, d.op);
  }
  WorkPtr do_all_to_all(const void* in, void* out, const CollectiveDesc& d) override {
    return flat_->all_to_all(in, out, d.count, d.dtype);
  }
  WorkPtr do_broadcast(void* buf, const CollectiveDesc& d) override {
    return flat_->broadcast(buf, d.count, d.dtype, d.root);
  }
  WorkPtr do_barrier(const CollectiveDesc&) override { return flat_->barrier(); }
  // W = 1: the flat communicator's own local copy or sum, in its memory (host or device).
  WorkPtr local_copy(const void* in, void* out, const CollectiveDesc& d) override {
    return flat_->all_gather(in, out, d.count, d.dtype, d.tag);
  }
  WorkPtr local_reduce_scatter_accumulate(const void* in, float* out, bool accumulate,
                                          const CollectiveDesc& d) override {
    return flat_->reduce_scatter_accumulate(in, d.dtype, out, d.count, accumulate, d.tag);
  }

  // Both hops run on this communicator's workers (Note [pipelined hops]): the call returns
  // a pending Work, which completes when hop 2 ends or hop 1 fails. Each worker works in its
  // own HopMemory (Note [two hops on the device]); what hop 1 leaves for hop 2 is in `between`.
  WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) override {
    if (d.count == 0) return std::make_shared<CompletedWork>(d, options().timeout);  // every rank: nothing moves
    const size_t chunk = d.count * dtype_size(d.dtype), world = nodes_ * per_node_;
    auto pair = std::make_shared<HopPair>(d, options().timeout, track_scratch((nodes_ + world) * chunk));
    auto between = std::make_shared<Between>();
    // Hop 1, across nodes: the chunks of this local index, [node]; hop 2 within the node: [local][node].
    auto hop1 = [this, pair, in, between, d, chunk] {
      pair->run_first("hop 1 (across nodes)", [&] {
        between->bytes = inter_mem_->scratch(nodes_ * chunk);
        inter_mem_->settle();  // the scratch is there before the collective writes it
        inter_->all_gather(in, between->bytes.get(), d.count, d.dtype, d.tag)->wait();
      });
    };
    auto hop2 = [this, pair, out, between, d, chunk, world] {
      pair->run_second("hop 2 (within the node)", [&] {
        std::shared_ptr<char> all = intra_mem_->scratch(world * chunk);
        intra_mem_->settle();  // the scratch is there before the collective writes it
        intra_->all_gather(between->bytes.get(), all.get(), nodes_ * d.count, d.dtype, d.tag)->wait();
        intra_mem_->after_caller();  // out: the caller's
        for (size_t l = 0; l < per_node_; ++l) {
          for (size_t k = 0; k < nodes_; ++k) {
            intra_mem_->copy(static_cast<char*>(out) + (k * per_node_ + l) * chunk,
                             all.get() + (l * nodes_ + k) * chunk, chunk);
          }
        }
        intra_mem_->settle();
      });
    };
    reserve(inter_hops_, std::move(hop1), intra_hops_, std::move(hop2));
    return pair->work();
  }

  WorkPtr do_reduce_scatter_accumulate(const void* in, float* out, bool accumulate, const CollectiveDesc& d) override {
    if (d.count == 0) return std::make_shared<CompletedWork>(d, options().timeout);
    const size_t n = d.count, chunk = n * dtype_size(d.dtype), world = nodes_ * per_node_;
    const size_t wire = inter_node_wire_bytes(wire_, n);  // one partial on the wire
    auto pair = std::make_shared<HopPair>(
        d, options().timeout, track_scratch(2 * world * chunk + nodes_ * (2 * n * sizeof(float) + 2 * wire)));
    auto between = std::make_shared<Between>();  // the node's N partial sums
    // Hop 1, within the node: to node-peer l the chunks of the ranks of local index l, [l][node],
    // then the node's partial sums.
    auto hop1 = [this, pair, in, between, d, n, chunk, world] {
      pair->run_first("hop 1 (within the node)", [&] {
        HopMemory& mem = *intra_mem_;
        const size_t g = per_node_, n_nodes = nodes_;
        std::shared_ptr<char> send = mem.scratch(world * chunk), got = mem.scratch(world * chunk);
        between->bytes = mem.scratch(n_nodes * n * sizeof(float));
        const char* x = static_cast<const char*>(in);
        mem.after_caller();  // in: the caller's
        for (size_t l = 0; l < g; ++l) {
          for (size_t k = 0; k < n_nodes; ++k)
            mem.copy(send.get() + (l * n_nodes + k) * chunk, x + (k * g + l) * chunk, chunk);
        }
        mem.settle();  // the all-to-all reads send
        intra_->all_to_all(send.get(), got.get(), n_nodes * n, d.dtype)->wait();
        for (size_t k = 0; k < n_nodes; ++k) {  // got is [from local][node]: regrouped as [node][from local]
          for (size_t l = 0; l < g; ++l)
            mem.copy(send.get() + (k * g + l) * chunk, got.get() + (l * n_nodes + k) * chunk, chunk);
        }
        auto* partial = reinterpret_cast<float*>(between->bytes.get());
        for (size_t k = 0; k < n_nodes; ++k)
          mem.sum_chunks(send.get() + k * g * chunk, d.dtype, g, n, partial + k * n, false);
        mem.settle();  // hop 2 reads the partials
      });
    };
    // Hop 2, across nodes: partial k to node k on the wire, summed in node order.
    auto hop2 = [this, pair, between, out, accumulate, n] {
      pair->run_second("hop 2 (across nodes)", [&] {
        inter_mem_->after_caller();  // out: the caller's (accumulate reads it)
        inter_mem_->sum_over_wire(*inter_, reinterpret_cast<const float*>(between->bytes.get()), n, wire_, out,
                                  accumulate);
        inter_mem_->settle();
      });
    };
    reserve(intra_hops_, std::move(hop1), inter_hops_, std::move(hop2));
    return pair->work();
  }

 private:
  std::shared_ptr<Communicator> flat_, intra_, inter_;
  InterNodeWire wire_;
  size_t per_node_, nodes_;
  std::string name_;
  std::unique_ptr<HopMemory> intra_mem_, inter_mem_;  // hop work of the intra and inter workers

  // A call's two hops, queued together: every queue sees the calls in the callers' order.
  void reserve(SerialQueue& first_queue, std::function<void()> first, SerialQueue& second_queue,
               std::function<void()> second) {
    std::lock_guard<std::mutex> lock(reserve_mu_);
    first_queue.push(std::move(first));
    second_queue.push(std::move(second));
  }

  std::mutex reserve_mu_;
  // Last, so they are destroyed first: each runs what is queued, then joins, while the
  // sub-communicators are still there.
  SerialQueue intra_hops_, inter_hops_;
};

}  // namespace

std::unique_ptr<Communicator> make_two_hop_communicator(std::shared_ptr<Communicator> flat,
                                                        std::shared_ptr<Communicator> intra,
                                                        std::shared_ptr<Communicator> inter, InterNodeWire wire,
                                                        CommOptions options, int device) {
  ZRT_CHECK(flat && intra && inter,
            "make_two_hop_communicator: needs the flat, intra-node and inter-node communicators");
  const bool on_device = flat->device_memory();
  ZRT_CHECK(intra->device_memory() == on_device && inter->device_memory() == on_device,
            "make_two_hop_communicator: the flat communicator '", flat->backend_name(), "' moves ",
            on_device ? "device" : "host", " memory, and its parts '", intra->backend_name(), "' and '",
            inter->backend_name(), "' must too (zerort.comm.topology.grid_parts makes them alike)");
  ZRT_CHECK(on_device == (device >= 0), "make_two_hop_communicator: '", flat->backend_name(), "' moves ",
            on_device ? "device memory: pass its CUDA device" : "host memory: pass device -1", ", got device ", device);
  const int g = intra->size(), nodes = inter->size();
  ZRT_CHECK(g * nodes == flat->size() && flat->rank() == inter->rank() * g + intra->rank(),
            "make_two_hop_communicator: rank ", flat->rank(), " of ", flat->size(), " is not node ", inter->rank(),
            " x ", g, " + local ", intra->rank(), " (", nodes, " nodes of ", g, " ranks, numbered node by node)");
  return std::make_unique<TwoHopCommunicator>(std::move(flat), std::move(intra), std::move(inter), wire, device,
                                              options);
}

Communicator* two_hop_flat(Communicator& comm) {
  auto* hops = dynamic_cast<TwoHopCommunicator*>(&comm);
  return hops ? const_cast<Communicator*>(&hops->flat()) : nullptr;
}

}  // namespace zerort
