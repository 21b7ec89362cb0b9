// The two-hop communicator on CUDA buffers (Note [two hops on the device]) against the host
// two-hop, bit for bit: 2 nodes x 2 ranks as threads of one process sharing one GPU, every part
// an in-process group staged for CUDA (comm/staged_communicator.h), so the device hops run at
// W = 4 on one GPU: the CUDA scratch, regrouping copies, FP64 local sums and the fp32, bf16,
// int8 and fp8_e4m3 wires as kernels. Sizes 0, 1, 257 and 1001, accumulate on and off, and the
// all-gather; and sum_over_wire_cuda / gather_over_wire_cuda (hybrid sharding's sum across nccl
// replicas) against the host functions at W = 3. Skipped without a CUDA device (scripts/gpu_check.sh runs it on the H200).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/inprocess_communicator.h"
#include "comm/staged_communicator.h"
#include "comm/two_hop_communicator.h"
#include "comm/wire_sum_cuda.h"
#include "core/cuda_check.h"
#include "two_hop_nodes.h"

namespace zerort {
namespace {

using testing::input;

constexpr int kNodes = 2, kPerNode = 2, kWorld = kNodes * kPerNode;

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// What a rank's reduce-scatter (twice: the second accumulates) and all-gather give.
struct Outputs {
  std::vector<float> reduced;
  std::vector<uint16_t> gathered;
};

std::shared_ptr<Communicator> on_device(std::unique_ptr<Communicator> inner) {
  return make_staged_communicator(std::move(inner), make_cuda_mover(0), {});
}

// Every rank's outputs over the two-hop communicator; device: its buffers and parts on cuda:0.
std::vector<Outputs> run(InterNodeWire wire, size_t n, bool device) {
  auto flat = InProcessGroup::create(kWorld);
  std::vector<std::shared_ptr<InProcessGroup>> intra, inter;
  for (int k = 0; k < kNodes; ++k) intra.push_back(InProcessGroup::create(kPerNode));
  for (int l = 0; l < kPerNode; ++l) inter.push_back(InProcessGroup::create(kNodes));
  std::vector<Outputs> out(kWorld);
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      try {
        CudaDeviceGuard guard(0);
        const int node = r / kPerNode, local = r % kPerNode;
        std::shared_ptr<Communicator> f = flat->communicator(r), a = intra[node]->communicator(local),
                                      b = inter[local]->communicator(node);
        if (device)
          f = on_device(flat->communicator(r)), a = on_device(intra[node]->communicator(local)),
          b = on_device(inter[local]->communicator(node));
        auto hops = make_two_hop_communicator(f, a, b, wire, {}, device ? 0 : -1);
        const std::vector<uint16_t> in = input(DType::kBFloat16, r, kWorld, n);
        Outputs& o = out[r];
        o.reduced.assign(n, 0.0f);
        o.gathered.assign(kWorld * n, 0);
        const size_t in_bytes = in.size() * 2, shard_bytes = n * 4, gathered_bytes = o.gathered.size() * 2;
        void *d_in = nullptr, *d_shard = nullptr, *d_all = nullptr;
        if (device) {
          ZRT_CHECK_CUDA(cudaMalloc(&d_in, in_bytes + 1));
          ZRT_CHECK_CUDA(cudaMalloc(&d_shard, shard_bytes + 1));
          ZRT_CHECK_CUDA(cudaMalloc(&d_all, gathered_bytes + 1));
          ZRT_CHECK_CUDA(cudaMemcpy(d_in, in.data(), in_bytes, cudaMemcpyHostToDevice));
        }
        const void* x = device ? d_in : in.data();
        auto* shard = device ? static_cast<float*>(d_shard) : o.reduced.data();
        hops->reduce_scatter_accumulate(x, DType::kBFloat16, shard, n, false, 1)->wait();
        hops->reduce_scatter_accumulate(x, DType::kBFloat16, shard, n, true, 2)->wait();
        // The all-gather of this rank's chunk of its input (bf16 as it is).
        const auto* mine = static_cast<const char*>(x) + static_cast<size_t>(r) * n * 2;
        hops->all_gather(mine, device ? d_all : o.gathered.data(), n, DType::kBFloat16, 3)->wait();
        if (device) {
          ZRT_CHECK_CUDA(cudaMemcpy(o.reduced.data(), d_shard, shard_bytes, cudaMemcpyDeviceToHost));
          ZRT_CHECK_CUDA(cudaMemcpy(o.gathered.data(), d_all, gathered_bytes, cudaMemcpyDeviceToHost));
          cudaFree(d_in), cudaFree(d_shard), cudaFree(d_all);
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return out;
}

class CudaTwoHop : public ::testing::TestWithParam<std::tuple<InterNodeWire, size_t>> {};

TEST_P(CudaTwoHop, DeviceHopsGiveTheHostBits) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device visible; the device two-hop test skipped";
  const auto [wire, n] = GetParam();
  const std::vector<Outputs> host = run(wire, n, false), device = run(wire, n, true);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(device[r].reduced.size(), host[r].reduced.size());
    EXPECT_EQ(std::memcmp(device[r].reduced.data(), host[r].reduced.data(), n * 4), 0) << "rank " << r << " reduce";
    EXPECT_EQ(device[r].gathered, host[r].gathered) << "rank " << r << " all-gather";
  }
}

// Rank r's partials (W x n) and, after the device or host functions, its sum and gather.
std::vector<float> wire_sums(InterNodeWire wire, size_t n, bool device) {
  constexpr int kRanks = 3;
  auto group = InProcessGroup::create(kRanks);
  std::vector<std::vector<float>> out(kRanks, std::vector<float>((kRanks + 1) * n));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      try {
        CudaDeviceGuard guard(0);
        std::shared_ptr<Communicator> comm = group->communicator(r);
        if (device) comm = on_device(group->communicator(r));
        std::vector<float> parts(kRanks * n);
        for (size_t i = 0; i < parts.size(); ++i) parts[i] = testing::value(r, 7, i) * (i % 5 == 0 ? 1e3f : 1.0f);
        float* sum = out[r].data();
        float* gathered = out[r].data() + n;
        if (!device) {
          sum_over_wire(*comm, parts.data(), n, wire, sum, false);
          gather_over_wire(*comm, sum, n, wire, gathered, 4);
          return;
        }
        void *d_parts = nullptr, *d_out = nullptr;
        ZRT_CHECK_CUDA(cudaMalloc(&d_parts, parts.size() * 4 + 4));
        ZRT_CHECK_CUDA(cudaMalloc(&d_out, out[r].size() * 4 + 4));
        ZRT_CHECK_CUDA(cudaMemcpy(d_parts, parts.data(), parts.size() * 4, cudaMemcpyHostToDevice));
        auto* d_sum = static_cast<float*>(d_out);
        sum_over_wire_cuda(*comm, static_cast<float*>(d_parts), n, wire, d_sum, false, cudaStreamLegacy);
        ZRT_CHECK_CUDA(cudaStreamSynchronize(cudaStreamLegacy));
        gather_over_wire_cuda(*comm, d_sum, n, wire, d_sum + n, 4, cudaStreamLegacy);
        ZRT_CHECK_CUDA(cudaMemcpy(out[r].data(), d_out, out[r].size() * 4, cudaMemcpyDeviceToHost));
        cudaFree(d_parts), cudaFree(d_out);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<float> all;
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    all.insert(all.end(), out[r].begin(), out[r].end());
  }
  return all;
}

TEST_P(CudaTwoHop, WireSumAndGatherOnTheDeviceGiveTheHostBits) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device visible; the device wire-sum test skipped";
  const auto [wire, n] = GetParam();
  const std::vector<float> host = wire_sums(wire, n, false), device = wire_sums(wire, n, true);
  ASSERT_EQ(host.size(), device.size());
  EXPECT_EQ(std::memcmp(host.data(), device.data(), host.size() * 4), 0);
}

INSTANTIATE_TEST_SUITE_P(Wires, CudaTwoHop,
                         ::testing::Combine(::testing::Values(InterNodeWire::kFp32, InterNodeWire::kBf16,
                                                              InterNodeWire::kInt8, InterNodeWire::kFp8),
                                            ::testing::Values(size_t{0}, size_t{1}, size_t{257}, size_t{1001})));

}  // namespace
}  // namespace zerort
