// Stage 3's units through the C++ Engine on W in {2, 4} in-process ranks: gather, prefetch,
// release and hold against the un-sharded parameters, a prefetched gather racing a release
// (one thread, then two), and whole steps bitwise equal to stage 2's, with and without
// delays before gathers or reduces (Note [delayed calls]). The units (default_units() in
// engine_cases.cpp) hold 434, 0, 217 and 7 elements: odd, empty, and not multiples of W;
// the last one is persistent. Steps against the FP64 reference: the EngineParity grid in
// test_engine.cpp.
#include <ATen/ops/equal.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include "core/error.h"
#include "core/half.h"
#include "engine_cases.h"
#include "run_ranks.h"

namespace zerort::testing {
namespace {

using std::chrono::microseconds;
using Params = std::vector<at::Tensor>;
constexpr size_t kUnits = 4, kPersistent = 3;
const std::vector<size_t> kSharded = {0, 1, 2};  // the units gathered on use

// The values a gathered parameter holds: the un-sharded FP32 parameter rounded to bf16.
at::Tensor expected(size_t param) { return init_params()[param].detach().to(at::kBFloat16); }

size_t storage_bytes(const at::Tensor& t) { return static_cast<size_t>(t.storage().nbytes()); }

bool whole(const Params& params, size_t param) {
  return params[param].sizes() == init_params()[param].sizes() && at::equal(params[param].detach(), expected(param));
}

// Runs body on W ranks, each with a stage-3 bf16 Engine over the MLP and default_units(),
// its calls checked across ranks as the Python engine's are (Note [checked calls]). A rank
// that fails leaves the others in a collective: they time out after 60 s.
void on_ranks(int world, const std::function<void(Engine&, Communicator&, Params&)>& body) {
  CommOptions options;
  options.timeout = std::chrono::seconds(60);
  auto errors = run_ranks(
      world,
      [&](Communicator& comm) {
        Params params = init_params();
        comm.check_each_call();
        Engine engine(params, comm, default_options(3, DType::kBFloat16), {}, default_units());
        body(engine, comm, params);
      },
      options);
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Waits (at most 60 s) until done() holds.
bool eventually(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

class EngineStage3 : public ::testing::TestWithParam<int> {};

TEST_P(EngineStage3, UnitsGatherTheUnshardedValues) {
  on_ranks(GetParam(), [](Engine& engine, Communicator&, Params& params) {
    ASSERT_EQ(engine.num_buckets(), kUnits);
    EXPECT_EQ(engine.gathered_bytes(), 0u);  // units start released ...
    for (size_t i : {0, 1, 3}) EXPECT_EQ(params[i].numel(), 0) << "parameter " << i;
    EXPECT_TRUE(whole(params, 4));  // ... but the persistent one, whole from the start
    for (size_t u : kSharded) engine.gather(u);
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(whole(params, i)) << "parameter " << i;
    // Counted: the working memory of the gathered units (the empty one has none).
    EXPECT_GT(storage_bytes(params[0]), 0u);
    EXPECT_EQ(storage_bytes(params[2]), 0u);
    EXPECT_EQ(engine.gathered_bytes(), storage_bytes(params[0]) + storage_bytes(params[3]));
    EXPECT_GE(engine.gathered_peak(), engine.gathered_bytes());
  });
}

TEST_P(EngineStage3, PrefetchStartsAGatherThatGatherCompletes) {
  on_ranks(GetParam(), [](Engine& engine, Communicator& comm, Params& params) {
    comm.delay_calls(DelayedCalls::kGathers, microseconds(2000));  // still in flight at gather()
    for (size_t u : kSharded) {
      const int64_t issued = comm.backend_calls();
      const size_t before = engine.gathered_bytes();
      engine.prefetch(u);
      if (u != 1) {  // unit 1 holds nothing to gather
        // Its storage is allocated at once, and the comm thread issues the all_gather with
        // no gather() call.
        EXPECT_GT(engine.gathered_bytes(), before) << "unit " << u;
        EXPECT_TRUE(eventually([&] { return comm.backend_calls() > issued; })) << "unit " << u;
      }
      engine.gather(u);
    }
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(whole(params, i)) << "parameter " << i;
    const int64_t issued = comm.backend_calls();
    engine.prefetch(0);  // gathered already: nothing to do
    engine.gather(0);
    EXPECT_EQ(comm.backend_calls(), issued);
  });
}

TEST_P(EngineStage3, ReleaseFreesStorageAndRegatherRestoresTheExactValues) {
  on_ranks(GetParam(), [](Engine& engine, Communicator&, Params& params) {
    for (size_t u : {size_t{0}, size_t{2}}) {
      const size_t param = u == 0 ? 0 : 3;
      engine.gather(u);
      const at::Tensor saved = params[param].detach();  // shares the unit's storage, as autograd's views do
      const at::Tensor values = saved.clone();
      const size_t bytes = storage_bytes(saved), held = engine.gathered_bytes();
      ASSERT_GT(bytes, 0u);
      engine.release(u);
      EXPECT_EQ(storage_bytes(saved), 0u) << "unit " << u;
      EXPECT_EQ(params[param].numel(), 0) << "unit " << u;
      EXPECT_EQ(engine.gathered_bytes(), held - bytes) << "unit " << u;
      engine.gather(u);  // into the same storage: the saved view holds the values again
      EXPECT_EQ(storage_bytes(saved), bytes) << "unit " << u;
      EXPECT_TRUE(at::equal(saved, values)) << "unit " << u;
      EXPECT_TRUE(whole(params, param)) << "unit " << u;
    }
    engine.release(kPersistent);  // a persistent unit stays whole
    EXPECT_TRUE(whole(params, 4));
  });
}

TEST_P(EngineStage3, HeldUnitsAreNotReleased) {
  on_ranks(GetParam(), [](Engine& engine, Communicator&, Params& params) {
    engine.hold_gathered(true);  // gathers every unit
    engine.hold_gathered(true);
    for (int depth = 2; depth > 0; --depth) {
      for (size_t u : kSharded) engine.release(u);
      for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(whole(params, i)) << "parameter " << i;
      EXPECT_GT(storage_bytes(params[0]), 0u);
      if (depth == 2) engine.hold_gathered(false);  // the inner hold ends: still held
    }
    const at::Tensor taken = params[0].detach();
    const at::Tensor values = taken.clone();
    engine.hold_gathered(false);  // the last hold ends: the units are released
    EXPECT_EQ(params[0].numel(), 0);
    EXPECT_EQ(engine.gathered_bytes(), 0u);
    // What was taken out during the hold keeps its bytes: Note [handed-off storage].
    EXPECT_TRUE(at::equal(taken, values));
    EXPECT_THROW(engine.hold_gathered(false), Error);
    engine.gather(0);
    EXPECT_TRUE(whole(params, 0));
  });
}

// The parameter views the unit's values, or is empty; the unit's storage is all there
// (gathered, or still gathering) or none of it (released), and counted as it is.
void expect_consistent(const Engine& engine, const Params& params, const at::Tensor& saved, size_t bytes,
                       const char* when) {
  EXPECT_EQ(engine.gathered_bytes(), storage_bytes(saved)) << when;
  if (params[0].numel() > 0) {
    EXPECT_TRUE(whole(params, 0)) << when;
    EXPECT_EQ(storage_bytes(saved), bytes) << when;
  } else {
    EXPECT_TRUE(storage_bytes(saved) == 0 || storage_bytes(saved) == bytes) << when;
  }
}

void expect_released(const Engine& engine, const Params& params, const at::Tensor& saved, const char* when) {
  EXPECT_EQ(params[0].numel(), 0) << when;
  EXPECT_EQ(storage_bytes(saved), 0u) << when;
  EXPECT_EQ(engine.gathered_bytes(), 0u) << when;
}

// Each round issues exactly one gather on every rank, whichever call wins: a release first
// is a no-op on a released unit, and a release second waits for the gather to land.
TEST_P(EngineStage3, PrefetchRacingAReleaseEndsConsistent) {
  on_ranks(GetParam(), [](Engine& engine, Communicator& comm, Params& params) {
    engine.gather(0);
    const at::Tensor saved = params[0].detach();
    const size_t bytes = storage_bytes(saved);
    engine.release(0);
    comm.delay_calls(DelayedCalls::kGathers, microseconds(comm.rank() % 2 ? 3000 : 500));
    for (int round = 0; round < 5; ++round) {  // prefetch, then release while it is in flight
      engine.prefetch(0);
      engine.release(0);
      expect_released(engine, params, saved, "prefetch then release");
    }
    for (int round = 0; round < 20; ++round) {  // prefetch and release on two threads
      std::thread releaser([&] { engine.release(0); });
      engine.prefetch(0);
      releaser.join();
      expect_consistent(engine, params, saved, bytes, "prefetch racing a release");
      engine.release(0);  // released on every rank: the next gather is one on every rank
      expect_released(engine, params, saved, "released after the race");
    }
    comm.delay_calls(DelayedCalls::kGathers, microseconds(0));
    engine.gather(0);
    EXPECT_TRUE(whole(params, 0));
  });
}

// gather() and release() of one unit on two threads. A release that comes while the
// gather's collective is in flight waits for it and then leaves the unit alone, since a
// gather() waits for it (See Note [unit cache]): the gather never hands back parameters
// over emptied storage (before, torch's setStorage error on one rank). A release that
// comes after gather() returned releases the unit, as it should. One gather per round on
// every rank: the unit is released before each.
TEST_P(EngineStage3, GatherRacingAReleaseEndsConsistent) {
  on_ranks(GetParam(), [](Engine& engine, Communicator& comm, Params& params) {
    engine.gather(0);
    const at::Tensor saved = params[0].detach();
    const size_t bytes = storage_bytes(saved);
    engine.release(0);
    comm.delay_calls(DelayedCalls::kGathers, microseconds(comm.rank() % 2 ? 3000 : 500));
    for (int round = 0; round < 20; ++round) {
      std::thread releaser([&] { engine.release(0); });
      try {
        engine.gather(0);  // threw when the release emptied the unit under it
      } catch (...) {
        releaser.join();
        throw;
      }
      releaser.join();
      expect_consistent(engine, params, saved, bytes, "gather racing a release");
      engine.release(0);
      expect_released(engine, params, saved, "released after the race");
    }
  });
}

// Zerort's promise: the stages agree bit for bit without clipping (stage 3 sums the norm's
// squares in another order), whether gradients are reported by hooks or left to step(),
// and however the comm threads are delayed (gathers on odd ranks, reduces on even ones).
TEST_P(EngineStage3, StepsEqualStage2Bitwise) {
  const int world = GetParam();
  RunConfig two, three;
  two.options = default_options(2, DType::kBFloat16);
  three.options = default_options(3, DType::kBFloat16);
  for (RunConfig* c : {&two, &three}) {
    c->options.optimizer.gradient_clipping = 0;
    c->options.optimizer.gradient_accumulation_steps = 2;
    c->steps = 4;
  }
  RunConfig hooks = three;
  hooks.report_grads = true;
  const auto base = run_all(world, two);
  auto same = [&](const std::vector<EngineRun>& runs, const char* what) {
    for (size_t r = 0; r < runs.size(); ++r) {
      ASSERT_EQ(runs[r].master.size(), base[0].master.size()) << what;
      EXPECT_EQ(0, std::memcmp(runs[r].master.data(), base[0].master.data(), base[0].master.size() * 4))
          << what << " rank " << r;
      EXPECT_EQ(runs[r].params, base[0].params) << what << " rank " << r;
    }
  };
  same(run_all(world, three), "stage 3");
  same(run_all(world, hooks), "stage 3, gradients reported by hooks");
  auto delayed = [](DelayedCalls calls, int parity) {
    return [=](Communicator& comm) {
      if (comm.rank() % 2 == parity) comm.delay_calls(calls, microseconds(300));
    };
  };
  same(run_all(world, hooks, delayed(DelayedCalls::kGathers, 1)), "stage 3, gathers delayed");
  same(run_all(world, hooks, delayed(DelayedCalls::kReduces, 0)), "stage 3, reduces delayed");
  same(run_all(world, two, delayed(DelayedCalls::kReduces, 1)), "stage 2, reduces delayed");
}

// gather_int8 (Note [int8 blocks]): every rank computes with the same decoded weights, each
// within half an int8 step (of the largest weight, which bounds its block's) of its master,
// plus two bf16 roundings; the weights really are quantized (not the plain run's), and a second
// run gives the same bits.
TEST_P(EngineStage3, Int8GathersGiveEveryRankTheSameWeightsWithinTheBound) {
  const int world = GetParam();
  RunConfig plain;
  plain.options = default_options(3, DType::kBFloat16);
  plain.steps = 4;
  RunConfig int8 = plain;
  int8.options.gather_int8 = true;
  const auto a = run_all(world, int8), again = run_all(world, int8), p = run_all(world, plain);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(a[r].params, a[0].params) << "rank " << r;
    EXPECT_EQ(a[r].master, again[r].master) << "rank " << r;
  }
  EXPECT_NE(a[0].params, p[0].params);
  float largest = 0;
  for (float m : a[0].master) largest = std::max(largest, std::fabs(m));
  ASSERT_EQ(a[0].params.size(), a[0].master.size());
  for (size_t i = 0; i < a[0].params.size(); ++i) {
    const double m = a[0].master[i], w = bf16_to_f32(a[0].params[i]);
    // Half a step of the block and the FP32 roundings, then bf16's unit roundoff 2^-8 twice:
    // the master cast into the chunk, and the decoded value cast back.
    const double step = largest * (1 + std::ldexp(1.0, -8)) * (1.0 / 254 + std::ldexp(1.0, -21));
    const double bound = (step + std::ldexp(std::fabs(m), -8) + std::ldexp(std::fabs(m) + step, -8)) * 1.001;
    EXPECT_LE(std::fabs(w - m), bound) << "element " << i << ": master " << m << ", weight " << w;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, EngineStage3, ::testing::Values(2, 4),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

// The knob itself: a delayed kind sleeps at least its delay; 0 turns it off; a negative
// delay is a ConfigError.
TEST(DelayedCalls, SleepBeforeEachCallOfTheirKind) {
  auto errors = run_ranks(2, [](Communicator& comm) {
    EXPECT_EQ(comm.call_delay(DelayedCalls::kGathers).count(), 0);
    EXPECT_THROW(comm.delay_calls(DelayedCalls::kReduces, microseconds(-1)), ConfigError);
    const auto delay = std::chrono::milliseconds(20);
    std::vector<float> in(3, 1.0f), out(6);
    for (DelayedCalls calls : {DelayedCalls::kGathers, DelayedCalls::kReduces}) {
      comm.delay_calls(calls, delay);
      EXPECT_EQ(comm.call_delay(calls), delay);
      const auto t0 = std::chrono::steady_clock::now();
      if (calls == DelayedCalls::kGathers)
        comm.all_gather(in.data(), out.data(), 3, DType::kFloat32)->wait();
      else
        comm.all_reduce(in.data(), 3, DType::kFloat32)->wait();
      EXPECT_GE(std::chrono::steady_clock::now() - t0, delay);
      comm.delay_calls(calls, microseconds(0));
    }
    EXPECT_EQ(comm.call_delay(DelayedCalls::kReduces).count(), 0);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

}  // namespace
}  // namespace zerort::testing
