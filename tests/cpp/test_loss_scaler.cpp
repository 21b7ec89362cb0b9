// LossScaler trajectories over scripted overflow (O) / clean (C) sequences, checked after
// every update against DeepSpeed >= 0.17.1 (its DynamicLossScaler after PR #6976): the
// trajectories its own tests state, written out as numbers, and hand-derived ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/loss_scaler.h"

namespace zerort {
namespace {

struct Expect {
  char event;  // 'O' overflow, 'C' clean
  double scale;
  int64_t hysteresis_left;
};

void run_script(LossScaler& s, const std::vector<Expect>& script) {
  for (size_t i = 0; i < script.size(); ++i) {
    s.update(script[i].event == 'O');
    EXPECT_EQ(s.scale(), script[i].scale) << "after update " << i << " (" << script[i].event << ")";
    EXPECT_EQ(s.state().hysteresis_left, script[i].hysteresis_left) << "after update " << i;
    EXPECT_EQ(s.state().iteration, static_cast<int64_t>(i + 1));
  }
}

LossScalerOptions opts(double initial, int64_t window, int64_t hysteresis, bool consecutive = false) {
  LossScalerOptions o;
  o.initial_scale = initial;
  o.window = window;
  o.hysteresis = hysteresis;
  o.consecutive_hysteresis = consecutive;
  return o;
}

TEST(LossScaler, DefaultsFollowDeepSpeed) {
  LossScaler s;
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().hysteresis_left, 2);
  for (int i = 0; i < 1000; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(false);  // the window counts from the second clean step: the 1001st doubles
  EXPECT_EQ(s.scale(), 131072.0);
  for (int i = 0; i < 999; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 131072.0);
  s.update(false);  // then every 1000 clean steps
  EXPECT_EQ(s.scale(), 262144.0);
}

TEST(LossScaler, WindowHysteresisAndBackoff) {
  LossScaler s(opts(8, 3, 2));
  run_script(s, {{'C', 8, 2},
                 {'C', 8, 2},
                 {'C', 8, 2},
                 {'C', 16, 2},  // the 4th clean step doubles
                 {'O', 16, 1},  // hysteresis absorbs one
                 {'O', 8, 1},
                 {'O', 4, 1},  // then every overflow halves
                 {'C', 4, 1},
                 {'C', 4, 1},
                 {'C', 4, 1},    // 3 clean: not yet
                 {'C', 8, 2}});  // the 4th clean step after the last overflow doubles and refills
  EXPECT_EQ(s.state().overflows, 3);
  EXPECT_EQ(s.state().last_overflow_iteration, 6);
}

// The example and DeepSpeed's own: from 2^8 with window 2, ten clean steps.
TEST(LossScaler, GrowsAfterWindowCleanStepsCountedFromTheStepAfterTheLastOverflow) {
  LossScaler s(opts(256, 2, 2));
  std::vector<double> got;
  for (int i = 0; i < 10; ++i) {
    s.update(false);
    got.push_back(s.scale());
  }
  EXPECT_EQ(got, (std::vector<double>{256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096}));
}

// Every trajectory that DeepSpeed's tests/unit/runtime/half_precision/
// test_dynamic_loss_scale.py (TestFused: FP16_Optimizer; TestUnfused: FP16_UnfusedOptimizer)
// and test_zero_optim_overflow.py (TestZeROFloat16, ZeRO 1 and 2) state, as numbers: the
// scale read after each step. DeepSpeed's FP16_Optimizer has no hysteresis (hysteresis 1
// here) and clamps at min_loss_scale; ZeRO's DynamicLossScaler, like ours, raises at an
// overflow with the scale already at the minimum, so those two runs end in an error where
// FP16_Optimizer would stay at the minimum. tests/python/test_loss_scale_rule.py runs the
// same table through the real engine.
struct Trajectory {
  const char* name;
  int initial_scale_power;
  int64_t window, hysteresis;
  double min_scale;
  bool consecutive;
  const char* events;          // 'O' overflow, 'C' clean, one per step
  std::vector<double> scales;  // after each step; fewer than events: the next one throws
};

const std::vector<Trajectory>& deepspeed_trajectories() {
  static const std::vector<Trajectory> t = {
      // test_no_overflow (TestFused, TestUnfused; TestZeROFloat16 with default hysteresis 2)
      {"no_overflow", 8, 2, 2, 1, false, "CCCCCCCCCC", {256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096}},
      {"no_overflow_hysteresis1",
       8,
       2,
       1,
       1,
       false,
       "CCCCCCCCCC",
       {256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096}},
      // test_some_overflow: 2 overflows (256 / 4), window + 1 clean (x 2), 1 overflow (/ 2)
      {"some_overflow", 8, 2, 1, 1, false, "OOCCCO", {128, 64, 64, 64, 128, 64}},
      // TestZeROFloat16.test_all_overflow: 2^8, hysteresis 1, 8 overflows, min 1 reached last
      {"zero_all_overflow", 8, 2, 1, 1, false, "OOOOOOOO", {128, 64, 32, 16, 8, 4, 2, 1}},
      // TestFused.test_all_overflow: 2^4, min 1 (FP16_Optimizer: 8, 4, 2, 1, 1, 1, 1, 1)
      {"fused_all_overflow", 4, 2, 1, 1, false, "OOOOOOOO", {8, 4, 2, 1}},
      // TestUnfused.test_all_overflow: 2^4, min 2 (FP16_UnfusedOptimizer: 8, 4, 2, 2, 2, 2, 2, 2)
      {"unfused_all_overflow", 4, 2, 1, 2, false, "OOOOOOOO", {8, 4, 2}},
      // Hand-derived from DeepSpeed's DynamicLossScaler.update_scale (its tests state none
      // with hysteresis > 1): hysteresis 2 absorbs one overflow and is refilled only by a
      // doubling; with consecutive_hysteresis by every clean step.
      {"hysteresis2", 8, 2, 2, 1, false, "OOCCCOCCOO", {256, 128, 128, 128, 256, 256, 256, 256, 128, 64}},
      {"hysteresis2_consecutive", 8, 2, 2, 1, true, "OOCCCOCCOO", {256, 128, 128, 128, 256, 256, 256, 256, 256, 128}},
  };
  return t;
}

TEST(LossScaler, DeepSpeedTrajectories) {
  for (const Trajectory& t : deepspeed_trajectories()) {
    LossScalerOptions o = opts(std::ldexp(1.0, t.initial_scale_power), t.window, t.hysteresis, t.consecutive);
    o.min_scale = t.min_scale;
    LossScaler s(o);
    const size_t steps = std::strlen(t.events);
    std::vector<double> got;
    for (size_t i = 0; i < steps; ++i) {
      if (i == t.scales.size()) {  // the overflow at the minimum scale
        try {
          s.update(t.events[i] == 'O');
          ADD_FAILURE() << t.name << ": no error at step " << i + 1;
        } catch (const Error& e) {
          const std::string want = "at step " + std::to_string(i + 1) + " with the loss scale already at its minimum";
          EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << t.name << ": " << e.what();
        }
        break;
      }
      s.update(t.events[i] == 'O');
      got.push_back(s.scale());
    }
    EXPECT_EQ(got, t.scales) << t.name;
  }
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnCleanStep) {
  LossScaler with(opts(8, 100, 2, true));
  run_script(with, {{'O', 8, 1}, {'C', 8, 2}, {'O', 8, 1}, {'O', 4, 1}, {'C', 4, 2}});
  LossScaler without(opts(8, 100, 2, false));
  run_script(without, {{'O', 8, 1}, {'C', 8, 1}, {'O', 4, 1}, {'C', 4, 1}});
}

TEST(LossScaler, MinimumScaleClampsThenErrors) {
  LossScalerOptions o = opts(4, 100, 1);
  o.min_scale = 1.5;
  LossScaler s(o);
  run_script(s, {{'O', 2, 1}, {'O', 1.5, 1}});  // clamped to the minimum
  try {
    s.update(true);
    FAIL() << "no error at the minimum scale";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("at step 3"), std::string::npos) << what;  // the third update
    EXPECT_NE(what.find("minimum 1.5"), std::string::npos) << what;
  }
}

TEST(LossScaler, StaticScaleNeverMovesButCountsSkips) {
  LossScalerOptions o;
  o.dynamic = false;
  o.initial_scale = 1.0;
  LossScaler s(o);
  for (bool overflow : {true, false, true, true}) s.update(overflow);
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_EQ(s.state().overflows, 3);
  EXPECT_EQ(s.state().iteration, 4);
}

TEST(LossScaler, SaveAndLoadContinuesIdentically) {
  LossScaler a(opts(1024, 4, 2));
  const char* events = "CCOCOOCCCCCOC";
  for (const char* e = events; *e; ++e) a.update(*e == 'O');
  LossScaler b(opts(1024, 4, 2));
  b.load_state(a.state());
  for (const char* e = "OCCCCCCOOC"; *e; ++e) {
    a.update(*e == 'O');
    b.update(*e == 'O');
    EXPECT_EQ(a.scale(), b.scale());
    EXPECT_EQ(a.state().hysteresis_left, b.state().hysteresis_left);
    EXPECT_EQ(a.state().iteration, b.state().iteration);
  }
  LossScaler::State bad = a.state();
  bad.scale = -1;
  EXPECT_THROW(b.load_state(bad), Error);
}

TEST(LossScaler, BadOptionsNameTheKey) {
  try {
    LossScaler(opts(8, 0, 2));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loss_scale.window"), std::string::npos);
  }
  EXPECT_THROW(LossScaler(opts(0, 10, 2)), Error);
  EXPECT_THROW(LossScaler(opts(8, 10, 0)), Error);
}

}  // namespace
}  // namespace zerort
