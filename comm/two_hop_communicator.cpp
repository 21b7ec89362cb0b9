#include "comm/two_hop_communicator.h"

#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/hop_pair.h"
#include "comm/local_reduce.h"
#include "comm/serial_queue.h"
#include "core/error.h"

namespace zerort {

namespace {

using Bytes = std::shared_ptr<char[]>;

Bytes bytes_of(size_t n) { return Bytes(new char[n > 0 ? n : 1]); }

// See Note [two hops].
class TwoHopCommunicator final : public Communicator {
 public:
  TwoHopCommunicator(std::shared_ptr<Communicator> flat, std::shared_ptr<Communicator> intra,
                     std::shared_ptr<Communicator> inter, InterNodeWire wire, CommOptions options)
      : Communicator(flat->rank(), flat->size(), options), flat_(std::move(flat)), intra_(std::move(intra)),
        inter_(std::move(inter)), wire_(wire), per_node_(static_cast<size_t>(intra_->size())),
        nodes_(static_cast<size_t>(inter_->size())), name_(std::string(flat_->backend_name()) + "+two-hop") {}

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

  // Both hops run on this communicator's workers (Note [pipelined hops]): the call returns
  // a pending Work, which completes when hop 2 ends or hop 1 fails.
  WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) override {
    if (d.count == 0) return std::make_shared<CompletedWork>(d, options().timeout);  // every rank: nothing moves
    const size_t chunk = d.count * dtype_size(d.dtype), world = nodes_ * per_node_;
    auto pair = std::make_shared<HopPair>(d, options().timeout, track_scratch((nodes_ + world) * chunk));
    Bytes same_local = bytes_of(nodes_ * chunk), all = bytes_of(world * chunk);
    // Hop 1, across nodes: the chunks of this local index, [node]; hop 2 within the node: [local][node].
    auto hop1 = [this, pair, in, same_local, d] {
      pair->run_first("hop 1 (across nodes)",
                      [&] { inter_->all_gather(in, same_local.get(), d.count, d.dtype, d.tag)->wait(); });
    };
    auto hop2 = [this, pair, out, same_local, all, d, chunk] {
      pair->run_second("hop 2 (within the node)", [&] {
        intra_->all_gather(same_local.get(), all.get(), nodes_ * d.count, d.dtype, d.tag)->wait();
        for (size_t l = 0; l < per_node_; ++l) {
          for (size_t k = 0; k < nodes_; ++k) {
            std::memcpy(static_cast<char*>(out) + (k * per_node_ + l) * chunk, all.get() + (l * nodes_ + k) * chunk,
                        chunk);
          }
        }
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
    auto partial = std::make_shared<std::vector<float>>(nodes_ * n);
    // Hop 1, within the node: to node-peer l the chunks of the ranks of local index l, [l][node],
    // then the node's partial sums.
    auto hop1 = [this, pair, in, partial, d, n, chunk, world] {
      pair->run_first("hop 1 (within the node)", [&] {
        const size_t g = per_node_, n_nodes = nodes_;
        Bytes send = bytes_of(world * chunk), got = bytes_of(world * chunk);
        const char* x = static_cast<const char*>(in);
        for (size_t l = 0; l < g; ++l) {
          for (size_t k = 0; k < n_nodes; ++k) {
            std::memcpy(send.get() + (l * n_nodes + k) * chunk, x + (k * g + l) * chunk, chunk);
          }
        }
        intra_->all_to_all(send.get(), got.get(), n_nodes * n, d.dtype)->wait();
        for (size_t k = 0; k < n_nodes; ++k) {  // got is [from local][node]: regrouped as [node][from local]
          for (size_t l = 0; l < g; ++l) {
            std::memcpy(send.get() + (k * g + l) * chunk, got.get() + (l * n_nodes + k) * chunk, chunk);
          }
        }
        for (size_t k = 0; k < n_nodes; ++k) {
          sum_chunks_to_f32(send.get() + k * g * chunk, d.dtype, g, n, partial->data() + k * n, false);
        }
      });
    };
    // Hop 2, across nodes: partial k to node k on the wire, summed in node order.
    auto hop2 = [this, pair, partial, out, accumulate, n] {
      pair->run_second("hop 2 (across nodes)",
                       [&] { sum_over_wire(*inter_, partial->data(), n, wire_, out, accumulate); });
    };
    reserve(intra_hops_, std::move(hop1), inter_hops_, std::move(hop2));
    return pair->work();
  }

 private:
  std::shared_ptr<Communicator> flat_, intra_, inter_;
  InterNodeWire wire_;
  size_t per_node_, nodes_;
  std::string name_;

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
                                                        CommOptions options) {
  ZRT_CHECK(flat && intra && inter,
            "make_two_hop_communicator: needs the flat, intra-node and inter-node communicators");
  ZRT_CHECK(!flat->device_memory() && !intra->device_memory() && !inter->device_memory(),
            "make_two_hop_communicator: '", flat->backend_name(),
            "' moves device memory; the two-hop pattern is built for host backends (mpi, gloo, inprocess)");
  const int g = intra->size(), nodes = inter->size();
  ZRT_CHECK(g * nodes == flat->size() && flat->rank() == inter->rank() * g + intra->rank(),
            "make_two_hop_communicator: rank ", flat->rank(), " of ", flat->size(), " is not node ", inter->rank(),
            " x ", g, " + local ", intra->rank(), " (", nodes, " nodes of ", g, " ranks, numbered node by node)");
  return std::make_unique<TwoHopCommunicator>(std::move(flat), std::move(intra), std::move(inter), wire, options);
}

}  // namespace zerort
