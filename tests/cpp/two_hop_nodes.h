// In-process groups playing N nodes of G ranks for the two-hop communicator (Note [two hops]):
// every rank's flat, intra-node and inter-node parts, a slowed inter-node part, and the
// inputs the two-hop tests reduce.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/inprocess_communicator.h"
#include "comm/two_hop_communicator.h"
#include "core/half.h"

namespace zerort::testing {

// A part that sleeps `delay` before each all-to-all it issues (the two-hop reduce's hop 2, which
// Communicator::delay_calls does not slow) and forwards every call to `inner`.
class SlowAllToAll final : public Communicator {
 public:
  SlowAllToAll(std::shared_ptr<Communicator> inner, std::chrono::microseconds delay)
      : Communicator(inner->rank(), inner->size(), inner->options()), inner_(std::move(inner)), delay_(delay) {}
  const char* backend_name() const override { return inner_->backend_name(); }

 protected:
  WorkPtr do_all_reduce(void* buf, const CollectiveDesc& d) override {
    return inner_->all_reduce(buf, d.count, d.dtype, d.op, d.tag);
  }
  WorkPtr do_reduce_scatter(const void* in, void* out, const CollectiveDesc& d) override {
    return inner_->reduce_scatter(in, out, d.count, d.dtype, d.op);
  }
  WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) override {
    return inner_->all_gather(in, out, d.count, d.dtype, d.tag);
  }
  WorkPtr do_all_to_all(const void* in, void* out, const CollectiveDesc& d) override {
    std::this_thread::sleep_for(delay_);
    return inner_->all_to_all(in, out, d.count, d.dtype);
  }
  WorkPtr do_broadcast(void* buf, const CollectiveDesc& d) override {
    return inner_->broadcast(buf, d.count, d.dtype, d.root);
  }
  WorkPtr do_barrier(const CollectiveDesc&) override { return inner_->barrier(); }

 private:
  std::shared_ptr<Communicator> inner_;
  std::chrono::microseconds delay_;
};

struct Nodes {
  int nodes = 2, per_node = 2;
  InterNodeWire wire = InterNodeWire::kFp32;
  bool abort_inter = false;   // every inter-node group fails its collectives from the start
  CommOptions inter_options;  // the inter-node groups' (their timeout bounds hop 2 and all_gather's hop 1)
  // Rank r's inter-node part, before the two-hop communicator takes it: may wrap or slow it.
  std::function<std::shared_ptr<Communicator>(std::shared_ptr<Communicator> inter, int rank)> inter_part;
};

// fn(two_hop, flat, rank) on every rank of the nodes, each thread its own communicators; what
// each rank threw ("" for none).
inline std::vector<std::string> run_nodes(const Nodes& shape,
                                          const std::function<void(Communicator&, Communicator&, int)>& fn) {
  const int world = shape.nodes * shape.per_node;
  auto flat = InProcessGroup::create(world);
  std::vector<std::shared_ptr<InProcessGroup>> intra, inter;
  for (int k = 0; k < shape.nodes; ++k) intra.push_back(InProcessGroup::create(shape.per_node));
  for (int l = 0; l < shape.per_node; ++l) inter.push_back(InProcessGroup::create(shape.nodes, shape.inter_options));
  for (auto& group : inter) {
    if (shape.abort_inter) group->abort("the link between the nodes is down (test)");
  }
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        const int node = r / shape.per_node, local = r % shape.per_node;
        std::shared_ptr<Communicator> f = flat->communicator(r);
        std::shared_ptr<Communicator> across = inter[static_cast<size_t>(local)]->communicator(node);
        if (shape.inter_part) across = shape.inter_part(std::move(across), r);
        auto two = make_two_hop_communicator(f, intra[static_cast<size_t>(node)]->communicator(local),
                                             std::move(across), shape.wire, {});
        fn(*two, *f, r);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Rank r's input element i of the chunk for rank j: magnitudes over 2^-10..2^10, both signs,
// exactly representable in bf16 and f16.
inline float value(int r, int j, size_t i) {
  const uint32_t h = (static_cast<uint32_t>(r) * 2654435761u) ^ (static_cast<uint32_t>(j) * 40503u) ^
                     (static_cast<uint32_t>(i) * 2246822519u);
  const float mantissa = static_cast<float>(static_cast<int>(h % 255) - 127) / 16.0f;
  return std::ldexp(mantissa, static_cast<int>((h >> 8) % 9) - 4);
}

// Rank r's reduce input: W chunks of n, chunk j for rank j, in dtype (bf16 or f16).
inline std::vector<uint16_t> input(DType dtype, int r, int world, size_t n) {
  std::vector<uint16_t> in(static_cast<size_t>(world) * n);
  for (int j = 0; j < world; ++j) {
    for (size_t i = 0; i < n; ++i) {
      const float x = value(r, j, i);
      in[static_cast<size_t>(j) * n + i] = dtype == DType::kBFloat16 ? f32_to_bf16(x) : f32_to_f16(x);
    }
  }
  return in;
}

}  // namespace zerort::testing
