// DeviceGradientStore (Note [gradient on the device]): master, m and v in a store made without
// a gradient (in memory, or the nvme tier split between RAM and a file), the gradient a tensor of
// the "device" (host memory on a CPU model, moved by the host Mover as a GPU's would be by the CUDA
// one). Its steps must equal the in-memory store's bit for bit, whatever the pieces. Files go
// under $ZERORT_IO_TEST_DIR (default /tmp).
#include <gtest/gtest.h>

#include <ATen/ops/zeros.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "io_test_util.h"
#include "nvme_state_test_util.h"
#include "runtime/device_gradient_store.h"
#include "runtime/kernel_dispatch.h"

namespace zerort::testing {
namespace {

using io::testing::TempDir;

enum class Inner { kMemory, kNvme, kNvmeSplit };

std::unique_ptr<OptimizerStateStore> inner_store(Inner kind, const at::Tensor& master, const std::string& dir,
                                                 size_t buffers) {
  if (kind == Inner::kMemory) return std::make_unique<InMemoryStateStore>(master.clone(), DType::kFloat32, false);
  NvmeStateOptions o = small_options(dir, buffers, false, kind == Inner::kNvmeSplit ? 0.5 : 0);
  o.with_gradient = false;
  return std::make_unique<NvmeStateStore>(master, DType::kFloat32, o);
}

// Three AdamW steps, the last in an order that jumps (the second half first), against the
// in-memory store: the same unscale figures, and the same master, m and v.
void expect_in_memory_bits(Inner kind, int64_t numel, size_t piece, size_t buffers) {
  SCOPED_TRACE(::testing::Message() << "inner " << static_cast<int>(kind) << ", numel " << numel << ", piece " << piece
                                    << ", buffers " << buffers);
  TempDir dir;
  const at::Tensor master = start_master(numel);
  InMemoryStateStore reference(master.clone(), DType::kFloat32);
  std::unique_ptr<Mover> mover = make_host_mover();
  DeviceGradientStore store(inner_store(kind, master, dir.path(), buffers), at::zeros({numel}, at::kFloat), *mover,
                            piece);
  const size_t n = static_cast<size_t>(numel);
  for (int round = 0; round < 3; ++round) {
    fill_grad(reference, round);
    fill_grad(store, round);
    const GradStats a = reference.unscale_and_check_grad(0.25f), b = store.unscale_and_check_grad(0.25f);
    EXPECT_EQ(a.nonfinite, b.nonfinite);
    EXPECT_EQ(a.sum_squares, b.sum_squares);
    AdamWStep s;
    s.step = round + 1;
    const auto adamw = [&](size_t, const AdamWBuffers& chunk) { adamw_step_on(c10::Device(c10::kCPU), chunk, s); };
    const std::vector<std::pair<size_t, size_t>> jump = {{n / 2, n - n / 2}, {0, n / 2}};
    if (round < 2) {
      reference.update(adamw);
      size_t next = 0;  // update(): pieces of at most `piece`, in offset order, the gradient in host staging
      store.update([&](size_t offset, const AdamWBuffers& chunk) {
        EXPECT_EQ(offset, next);
        EXPECT_LE(chunk.n, piece);
        EXPECT_NE(chunk.grad, static_cast<const void*>(store.grad().data_ptr<float>() + offset));
        next = offset + chunk.n;
        adamw(offset, chunk);
      });
      EXPECT_EQ(next, n);
    } else {
      reference.update_ranges(jump, adamw);
      store.update_ranges(jump, adamw);
    }
    reference.zero_grad();
    store.zero_grad();
  }
  EXPECT_EQ(store.grad().count_nonzero().item<int64_t>(), 0);
  const Snapshot a = snapshot(reference), b = snapshot(store);
  EXPECT_EQ(a.master, b.master);
  EXPECT_EQ(a.exp_avg, b.exp_avg);
  EXPECT_EQ(a.exp_avg_sq, b.exp_avg_sq);
}

TEST(DeviceGradientStore, StepsAsTheInMemoryStoreBitwise) {
  TempDir probe;
  const int64_t chunk = static_cast<int64_t>(smallest_chunk(probe.path()));
  for (Inner kind : {Inner::kMemory, Inner::kNvme, Inner::kNvmeSplit}) {
    for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{1001}, 7 * chunk + 5}) {
      for (size_t piece : {size_t{1}, size_t{7}, size_t{1} << 20}) {
        if (piece == 1 && numel > 1001) continue;  // one element a copy: slow, and no different
        expect_in_memory_bits(kind, numel, piece, kind == Inner::kNvme ? 1 : 3);
      }
    }
  }
}

TEST(DeviceGradientStore, TheInnerStoreHasNoGradient) {
  TempDir dir;
  const at::Tensor master = start_master(300);
  std::unique_ptr<Mover> mover = make_host_mover();
  for (Inner kind : {Inner::kMemory, Inner::kNvmeSplit}) {
    DeviceGradientStore store(inner_store(kind, master, dir.path(), 2), at::zeros({300}, at::kFloat), *mover, 64);
    EXPECT_THROW(store.inner().grad(), UsageError);
    const StateTierStats s = store.tier_stats();
    EXPECT_TRUE(s.gradient_on_device);
    EXPECT_EQ(s.pool_bytes, store.inner().tier_stats().pool_bytes + 64 * sizeof(float));
    EXPECT_EQ(s.tier, kind == Inner::kMemory ? StateTier::kMemory : StateTier::kNvme);
    EXPECT_TRUE(store.device().is_cpu());
  }
}

TEST(DeviceGradientStore, RefusesAGradientOfTheWrongSizeAndTheGradientInTheFile) {
  TempDir dir;
  const at::Tensor master = start_master(300);
  std::unique_ptr<Mover> mover = make_host_mover();
  EXPECT_THROW(
      DeviceGradientStore(inner_store(Inner::kMemory, master, dir.path(), 2), at::zeros({299}, at::kFloat), *mover, 64),
      Error);
  NvmeStateOptions o = small_options(dir.path(), 2, /*gradient_in_file=*/true);
  o.with_gradient = false;
  try {
    NvmeStateStore store(master, DType::kFloat32, o);
    ADD_FAILURE() << "gradient_in_file without a gradient was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("with_gradient"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace zerort::testing
