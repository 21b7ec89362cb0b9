// NvmeStateStore: the nvme tier's AdamW steps equal the in-memory tier's bit for bit (master,
// m, v and the low-precision output), a short read is an error that names the file and the
// offset and leaves the store refusing further use, the pool does not grow with the state.
// See Note [NVMe state store]. Files go under $ZERORT_IO_TEST_DIR (default /tmp).
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/alignment.h"
#include "io_test_util.h"
#include "nvme_state_test_util.h"
#include "run_ranks.h"
#include "runtime/nvme_state_store.h"
#include "runtime/shard_optimizer.h"

namespace zerort::testing {
namespace {

using io::testing::TempDir;

// `steps` AdamW steps of the same gradients through both tiers, with two hyper groups and a
// bf16 output segment that cross chunk boundaries; every output and the final state compared
// bit for bit.
void expect_tiers_equal(int64_t numel, DType state_dtype, size_t buffer_count, bool gradient_in_file = false,
                        int steps = 3, double ram_fraction = 0) {
  TempDir dir;
  auto errors = run_ranks(1, [&](Communicator& comm) {
    OptimizerOptions o;
    o.state_dtype = state_dtype;
    o.gradient_clipping = 1.0;
    o.adamw.weight_decay = 0.01;
    const at::Tensor master = start_master(numel);
    auto nvme = std::make_unique<NvmeStateStore>(
        master, state_dtype, small_options(dir.path(), buffer_count, gradient_in_file, ram_fraction));
    NvmeStateStore& store = *nvme;
    ShardOptimizer in_memory(master.clone(), comm, o), on_disk(std::move(nvme), comm, o);
    const int64_t third = numel / 3;
    const std::vector<AdamWHyper> hypers = {o.adamw, {3e-3, 0.8, 0.99, 1e-6, 0.1}};
    in_memory.set_hyper_groups(hypers, {{third, third, 1}});
    on_disk.set_hyper_groups(hypers, {{third, third, 1}});
    const size_t out_at = static_cast<size_t>(numel / 4), out_n = static_cast<size_t>(numel / 2);
    for (int step = 0; step < steps; ++step) {
      std::vector<uint16_t> out_a(out_n), out_b(out_n);
      StepStats sa, sb;
      fill_grad(in_memory.grad_shard(), step);
      fill_grad(on_disk.state(), step);
      // Odd steps read ahead first, while the last step's final writes may be in flight.
      if (step % 2 == 1) on_disk.state().prefetch();
      ASSERT_TRUE(in_memory.step({{out_at, out_n, out_a.data(), DType::kBFloat16}}, sa));
      ASSERT_TRUE(on_disk.step({{out_at, out_n, out_b.data(), DType::kBFloat16}}, sb));
      EXPECT_EQ(sa.grad_norm, sb.grad_norm);
      EXPECT_EQ(out_a, out_b) << "bf16 output of step " << step;
    }
    const Snapshot a = snapshot(in_memory.state()), b = snapshot(on_disk.state());
    EXPECT_EQ(std::memcmp(a.master.data(), in_memory.master().data_ptr<float>(), a.master.size() * 4), 0);
    EXPECT_EQ(a.master, b.master) << "master";
    EXPECT_EQ(a.exp_avg, b.exp_avg) << "m";
    EXPECT_EQ(a.exp_avg_sq, b.exp_avg_sq) << "v";
    if (numel > 0) {
      EXPECT_NE(a.master[0], master.data_ptr<float>()[0]) << "the steps moved nothing";
    }
    // Each step writes every record (and the gradient, when in the file) once; initialize the records.
    const uint64_t records = store.records_bytes(), gradient = store.file_bytes() - records;
    EXPECT_EQ(gradient > 0, gradient_in_file && numel > 0);
    EXPECT_EQ(store.bytes_written(), records * static_cast<uint64_t>(steps + 1) + gradient * steps);
    // Split: the first floor(fraction x chunks) records in RAM, the rest in the file, each step reading only those.
    const size_t chunks = store.chunk_count(), in_ram = static_cast<size_t>(ram_fraction * static_cast<double>(chunks));
    EXPECT_EQ(store.ram_chunks(), in_ram);
    EXPECT_EQ(store.ram_bytes(), in_ram * store.chunk_stride());
    EXPECT_EQ(records, (chunks - in_ram) * store.chunk_stride());
  });
  EXPECT_EQ(errors[0], "") << "numel " << numel << ", " << dtype_name(state_dtype) << ", " << buffer_count
                           << " buffers, gradient in the file " << gradient_in_file << ", ram_fraction "
                           << ram_fraction;
}

TEST(NvmeStateStore, AdamWStepsEqualTheInMemoryTierBitwise) {
  TempDir probe;
  const int64_t chunk = static_cast<int64_t>(smallest_chunk(probe.path()));
  const size_t buffers = 3;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    // 0, 1, odd, not a multiple of the chunk, more than the pool holds.
    for (int64_t numel :
         {int64_t{0}, int64_t{1}, int64_t{1001}, 2 * chunk + 77, static_cast<int64_t>(buffers) * chunk * 2 + 5}) {
      expect_tiers_equal(numel, dtype, buffers);
      expect_tiers_equal(numel, dtype, buffers, true);
    }
  }
}

// A split between RAM and the file: the same steps, whatever part is in RAM (none of the file read
// ahead past the pool; all of it in RAM; every record but one), and for 1 and 2 buffers.
TEST(NvmeStateStore, ASplitBetweenRamAndTheFileStepsEqualTheInMemoryTierBitwise) {
  TempDir probe;
  const int64_t chunk = static_cast<int64_t>(smallest_chunk(probe.path()));
  for (double fraction : {0.34, 0.5, 0.9, 1.0}) {
    for (size_t buffers : {size_t{1}, size_t{3}}) {
      expect_tiers_equal(7 * chunk + 5, DType::kFloat32, buffers, false, 3, fraction);
    }
    expect_tiers_equal(int64_t{0}, DType::kBFloat16, 2, false, 2, fraction);
    expect_tiers_equal(int64_t{1001}, DType::kBFloat16, 2, false, 2, fraction);
  }
}

// Ranges that cross from the RAM records into the file's, both ways, keep every other value.
TEST(NvmeStateStore, RangesAcrossTheSplitKeepTheOtherValues) {
  TempDir dir;
  const size_t chunk = smallest_chunk(dir.path()), n = 4 * chunk + 9;
  NvmeStateStore store(start_master(static_cast<int64_t>(n)), DType::kFloat32,
                       small_options(dir.path(), 2, false, 0.5));
  ASSERT_EQ(store.ram_chunks(), 2u);
  const Snapshot before = snapshot(store);
  const at::Tensor master = start_master(static_cast<int64_t>(n));
  EXPECT_EQ(std::memcmp(before.master.data(), master.data_ptr<float>(), n * 4), 0) << "the initial master";
  std::vector<float> put(chunk + 20), m(put.size(), 1.5f);
  for (size_t i = 0; i < put.size(); ++i) put[i] = static_cast<float>(i) + 0.5f;
  const size_t at = 2 * chunk - 10;  // the last RAM record's end and the first file record's start
  store.write_range(at, put.size(), put.data(), m.data(), nullptr);
  const Snapshot after = snapshot(store);
  for (size_t i = 0; i < n; ++i) {
    const bool in = i >= at && i < at + put.size();
    EXPECT_EQ(after.master[i], in ? put[i - at] : before.master[i]) << i;
    float mi;
    std::memcpy(&mi, after.exp_avg.data() + 4 * i, 4);
    EXPECT_EQ(mi, in ? 1.5f : 0.0f) << i;
  }
  EXPECT_EQ(after.exp_avg_sq, before.exp_avg_sq);
  std::vector<float> part(chunk + 20);
  store.read_range(at, part.size(), part.data(), nullptr, nullptr);
  EXPECT_EQ(part, put);
}

TEST(NvmeStateStore, ABadSplitIsRefusedNamingTheKey) {
  TempDir dir;
  for (double fraction : {-0.1, 1.5}) {
    try {
      NvmeStateStore store(start_master(5), DType::kFloat32, small_options(dir.path(), 1, false, fraction));
      FAIL() << "ram_fraction " << fraction << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("ram_fraction"), std::string::npos) << e.what();
    }
  }
  try {
    NvmeStateStore store(start_master(5), DType::kFloat32, small_options(dir.path(), 1, true, 0.5));
    FAIL() << "a split with the gradient in the file was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("gradient_in_file"), std::string::npos) << e.what();
  }
}

// A direct write after a read ahead: the step reads the new values, not what was read before.
TEST(NvmeStateStore, AWriteAfterAReadAheadIsWhatTheStepReads) {
  TempDir dir;
  const int64_t numel = 4 * static_cast<int64_t>(smallest_chunk(dir.path())) + 9;
  auto errors = run_ranks(1, [&](Communicator& comm) {
    OptimizerOptions o;
    const at::Tensor master = start_master(numel);
    ShardOptimizer in_memory(master.clone(), comm, o);
    ShardOptimizer on_disk(std::make_unique<NvmeStateStore>(master, o.state_dtype, small_options(dir.path(), 3)), comm,
                           o);
    StepStats stats;
    for (ShardOptimizer* opt : {&in_memory, &on_disk}) {
      fill_grad(opt->grad_shard(), 0);
      ASSERT_TRUE(opt->step({}, stats));  // its last writes stay in flight
      opt->state().prefetch();            // reads chunk 0 and on, the old values
      const std::vector<float> fresh(static_cast<size_t>(numel), 0.25f);
      opt->state().write_range(0, fresh.size(), fresh.data(), nullptr, nullptr);
      fill_grad(opt->grad_shard(), 1);
      ASSERT_TRUE(opt->step({}, stats));
    }
    const Snapshot a = snapshot(in_memory.state()), b = snapshot(on_disk.state());
    EXPECT_EQ(a.master, b.master);
    EXPECT_EQ(a.exp_avg_sq, b.exp_avg_sq);
  });
  EXPECT_EQ(errors[0], "");
}

TEST(NvmeStateStore, OneOrTwoBuffersGiveTheSameSteps) {
  TempDir probe;
  const int64_t numel = 5 * static_cast<int64_t>(smallest_chunk(probe.path())) + 3;
  for (size_t buffers : {size_t{1}, size_t{2}}) {
    for (bool gradient_in_file : {false, true})
      expect_tiers_equal(numel, DType::kBFloat16, buffers, gradient_in_file, 2);
  }
}

TEST(NvmeStateStore, ThePoolDoesNotGrowWithTheState) {
  TempDir dir;
  const size_t chunk = smallest_chunk(dir.path());
  NvmeStateOptions o = small_options(dir.path(), 3);
  NvmeStateStore small(start_master(10), DType::kFloat32, o);
  o.rank = 1;
  NvmeStateStore large(start_master(static_cast<int64_t>(40 * chunk + 1)), DType::kFloat32, o);
  EXPECT_EQ(small.pool_bytes(), large.pool_bytes());
  EXPECT_EQ(large.pool_bytes(), 3 * chunk * 12);  // master 4 + m 4 + v 4 bytes per element
  EXPECT_EQ(large.file_bytes(), 41 * chunk * 12);
  EXPECT_NE(large.path().find("zerort-states-rank1.bin"), std::string::npos) << large.path();
}

TEST(NvmeStateStore, RangesStreamAcrossChunksAndKeepTheOtherArrays) {
  TempDir dir;
  const size_t chunk = smallest_chunk(dir.path()), n = 3 * chunk + 9;
  NvmeStateStore store(start_master(static_cast<int64_t>(n)), DType::kBFloat16, small_options(dir.path(), 2));
  const Snapshot before = snapshot(store);
  std::vector<float> put(chunk + 20);
  for (size_t i = 0; i < put.size(); ++i) put[i] = static_cast<float>(i) + 0.5f;
  std::vector<uint16_t> ones(put.size(), 0x3f80);  // bf16 1.0
  store.write_range(chunk - 10, put.size(), put.data(), ones.data(), nullptr);
  const Snapshot after = snapshot(store);
  for (size_t i = 0; i < n; ++i) {
    const bool in = i >= chunk - 10 && i < chunk - 10 + put.size();
    EXPECT_EQ(after.master[i], in ? put[i - (chunk - 10)] : before.master[i]) << i;
    uint16_t m;
    std::memcpy(&m, after.exp_avg.data() + 2 * i, 2);
    EXPECT_EQ(m, in ? 0x3f80 : 0) << i;
  }
  EXPECT_EQ(after.exp_avg_sq, before.exp_avg_sq);
  EXPECT_THROW(store.read_range(n - 1, 2, put.data(), nullptr, nullptr), Error);
}

TEST(NvmeStateStore, WholeTensorsAreRefusedByName) {
  TempDir dir;
  NvmeStateStore store(start_master(5), DType::kFloat32, small_options(dir.path(), 1));
  try {
    store.master();
    FAIL() << "master() returned";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("master()"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("read_range"), std::string::npos) << e.what();
  }
  EXPECT_THROW(store.exp_avg(), UsageError);
  EXPECT_THROW(store.exp_avg_sq(), UsageError);
  EXPECT_NO_THROW(store.grad());  // in memory
  TempDir other;                  // a second store in one directory would be a second job there (refused by its lock)
  NvmeStateStore gradient_too(start_master(5), DType::kFloat32, small_options(other.path(), 1, true));
  try {
    gradient_too.grad();
    FAIL() << "grad() returned with the gradient in the file";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("read_grad"), std::string::npos) << e.what();
  }
  EXPECT_THROW(NvmeStateStore(start_master(5), DType::kFloat32, small_options(dir.sub("missing"), 1)), ConfigError);
}

// The file cut short behind the store's back: the step fails naming the file and an offset,
// and the store, whose records now mix two steps, refuses every later step and read.
TEST(NvmeStateStore, AShortReadNamesTheFileAndOffsetAndStopsTheStore) {
  TempDir dir;
  const size_t chunk = smallest_chunk(dir.path());
  auto errors = run_ranks(1, [&](Communicator& comm) {
    OptimizerOptions o;
    auto nvme = std::make_unique<NvmeStateStore>(start_master(static_cast<int64_t>(5 * chunk + 3)), o.state_dtype,
                                                 small_options(dir.path(), 2));
    NvmeStateStore& store = *nvme;
    ShardOptimizer opt(std::move(nvme), comm, o);
    StepStats stats;
    fill_grad(opt.grad_shard(), 0);
    ASSERT_TRUE(opt.step({}, stats));
    float first;
    store.read_range(0, 1, &first, nullptr, nullptr);  // waits for the step's last writes, which would regrow the file
    ASSERT_EQ(::truncate(store.path().c_str(), static_cast<off_t>(2 * store.chunk_stride())), 0);
    fill_grad(opt.grad_shard(), 1);
    std::string msg;
    try {
      opt.step({}, stats);
    } catch (const Error& e) {
      msg = e.what();
    }
    ASSERT_FALSE(msg.empty()) << "the short read was not an error";
    EXPECT_NE(msg.find(store.path()), std::string::npos) << msg;
    EXPECT_NE(msg.find("offset"), std::string::npos) << msg;
    EXPECT_FALSE(store.failure().empty());
    float x;
    EXPECT_THROW(store.read_range(0, 1, &x, nullptr, nullptr), Error);
    try {
      opt.step({}, stats);
      FAIL() << "a step ran on a failed store";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("unusable"), std::string::npos) << e.what();
    }
  });
  EXPECT_EQ(errors[0], "");
}

}  // namespace
}  // namespace zerort::testing
