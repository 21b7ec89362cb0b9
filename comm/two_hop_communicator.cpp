#include "comm/two_hop_communicator.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "comm/int8_blocks.h"
#include "comm/local_reduce.h"
#include "core/error.h"
#include "core/half.h"

namespace zerort {

namespace {

using Bytes = std::shared_ptr<char[]>;

Bytes bytes_of(size_t n) { return Bytes(new char[n > 0 ? n : 1]); }

// Issues one hop's collective and waits for it; a failure (at the call or in the wait) is
// rethrown as the same kind of error, naming the caller's collective (`outer`) and the hop
// before the part's own message.
template <typename Issue>
void run_hop(const CollectiveDesc& outer, const char* hop, Issue&& issue) {
  try {
    issue()->wait();
  } catch (const Error& e) {
    const std::string msg = detail::concat(outer.to_string(), ", ", hop, ": ", e.message());
    if (dynamic_cast<const CollectiveMismatchError*>(&e)) throw CollectiveMismatchError(__FILE__, __LINE__, msg);
    if (dynamic_cast<const CommTimeoutError*>(&e)) throw CommTimeoutError(__FILE__, __LINE__, msg);
    if (dynamic_cast<const CommError*>(&e)) throw CommError(__FILE__, __LINE__, msg);
    throw Error(__FILE__, __LINE__, msg);
  }
}

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

  // The two hops run on the calling thread, each waited for (run_hop), so a call returns
  // done: a failure names this collective and its hop, and no buffer is written later.
  WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) override {
    if (d.count == 0) return std::make_shared<CompletedWork>(d, options().timeout);  // every rank: nothing moves
    const size_t chunk = d.count * dtype_size(d.dtype), world = nodes_ * per_node_;
    Bytes same_local = bytes_of(nodes_ * chunk), all = bytes_of(world * chunk);
    auto token = track_scratch((nodes_ + world) * chunk);
    // Hop 1, across nodes: the chunks of this local index, [node]; hop 2 within the node: [local][node].
    run_hop(d, "hop 1 (across nodes)",
            [&] { return inter_->all_gather(in, same_local.get(), d.count, d.dtype, d.tag); });
    run_hop(d, "hop 2 (within the node)",
            [&] { return intra_->all_gather(same_local.get(), all.get(), nodes_ * d.count, d.dtype, d.tag); });
    for (size_t l = 0; l < per_node_; ++l) {
      for (size_t k = 0; k < nodes_; ++k) {
        std::memcpy(static_cast<char*>(out) + (k * per_node_ + l) * chunk, all.get() + (l * nodes_ + k) * chunk, chunk);
      }
    }
    return std::make_shared<CompletedWork>(d, options().timeout);
  }

  WorkPtr do_reduce_scatter_accumulate(const void* in, float* out, bool accumulate, const CollectiveDesc& d) override {
    if (d.count == 0) return std::make_shared<CompletedWork>(d, options().timeout);
    const size_t n = d.count, chunk = n * dtype_size(d.dtype), world = nodes_ * per_node_;
    const size_t g = per_node_, n_nodes = nodes_;
    const size_t wire = inter_node_wire_bytes(wire_, n);  // one partial on the wire
    auto token = track_scratch(2 * world * chunk + n_nodes * (2 * n * sizeof(float) + 2 * wire));
    // Hop 1, within the node: to node-peer l the chunks of the ranks of local index l, [l][node].
    Bytes send = bytes_of(world * chunk), got = bytes_of(world * chunk);
    const char* x = static_cast<const char*>(in);
    for (size_t l = 0; l < g; ++l) {
      for (size_t k = 0; k < n_nodes; ++k) {
        std::memcpy(send.get() + (l * n_nodes + k) * chunk, x + (k * g + l) * chunk, chunk);
      }
    }
    run_hop(d, "hop 1 (within the node)",
            [&] { return intra_->all_to_all(send.get(), got.get(), n_nodes * n, d.dtype); });
    for (size_t k = 0; k < n_nodes; ++k) {  // got is [from local][node]: regrouped as [node][from local]
      for (size_t l = 0; l < g; ++l) {
        std::memcpy(send.get() + (k * g + l) * chunk, got.get() + (l * n_nodes + k) * chunk, chunk);
      }
    }
    std::vector<float> partial(n_nodes * n);
    for (size_t k = 0; k < n_nodes; ++k) {
      sum_chunks_to_f32(send.get() + k * g * chunk, d.dtype, g, n, partial.data() + k * n, false);
    }
    // Hop 2, across nodes: partial k to node k on the wire, summed in node order.
    Bytes to_nodes = bytes_of(n_nodes * wire), from_nodes = bytes_of(n_nodes * wire);
    for (size_t k = 0; k < n_nodes; ++k) encode(partial.data() + k * n, n, to_nodes.get() + k * wire);
    run_hop(d, "hop 2 (across nodes)", [&] {  // 8-bit: opaque 32-bit words (int8_wire_bytes is a multiple of 4)
      return eight_bit() ? inter_->all_to_all(to_nodes.get(), from_nodes.get(), wire / 4, DType::kInt32)
                         : inter_->all_to_all(to_nodes.get(), from_nodes.get(), n, wire_dtype());
    });
    if (eight_bit()) {  // decoded to FP32, then summed as the others
      for (size_t k = 0; k < n_nodes; ++k) {
        float* to = partial.data() + k * n;
        const char* from = from_nodes.get() + k * wire;
        wire_ == InterNodeWire::kInt8 ? decode_int8_blocks(from, n, to) : decode_fp8_blocks(from, n, to);
      }
      sum_chunks_to_f32(partial.data(), DType::kFloat32, n_nodes, n, out, accumulate);
    } else {
      sum_chunks_to_f32(from_nodes.get(), wire_dtype(), n_nodes, n, out, accumulate);
    }
    return std::make_shared<CompletedWork>(d, options().timeout);
  }

 private:
  DType wire_dtype() const { return wire_ == InterNodeWire::kBf16 ? DType::kBFloat16 : DType::kFloat32; }
  bool eight_bit() const { return wire_ == InterNodeWire::kInt8 || wire_ == InterNodeWire::kFp8; }
  // One partial of n FP32 values onto the wire.
  void encode(const float* partial, size_t n, char* to) const {
    if (wire_ == InterNodeWire::kInt8) {
      encode_int8_blocks(partial, n, to);
    } else if (wire_ == InterNodeWire::kFp8) {
      encode_fp8_blocks(partial, n, to);
    } else if (wire_ == InterNodeWire::kBf16) {
      auto* h = reinterpret_cast<uint16_t*>(to);
      for (size_t i = 0; i < n; ++i) h[i] = f32_to_bf16(partial[i]);
    } else {
      std::memcpy(to, partial, n * sizeof(float));
    }
  }

  std::shared_ptr<Communicator> flat_, intra_, inter_;
  InterNodeWire wire_;
  size_t per_node_, nodes_;
  std::string name_;
};

}  // namespace

InterNodeWire parse_inter_node_wire(const std::string& name) {
  if (name == "fp32") return InterNodeWire::kFp32;
  if (name == "bf16") return InterNodeWire::kBf16;
  if (name == "int8") return InterNodeWire::kInt8;
  if (name == "fp8_e4m3") return InterNodeWire::kFp8;
  ZRT_THROW_AS(ConfigError, "comm.inter_node_dtype: got '", name, "'; expected fp32, bf16, int8 or fp8_e4m3");
}

size_t inter_node_wire_bytes(InterNodeWire wire, size_t n) {
  if (wire == InterNodeWire::kInt8 || wire == InterNodeWire::kFp8) return int8_wire_bytes(n);
  return n * (wire == InterNodeWire::kBf16 ? 2 : 4);
}

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
