// LossScaler trajectories over scripted overflow (O) / clean (C) sequences, checked
// against hand-derived DeepSpeed semantics after every update.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm/error.h"
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
  for (int i = 0; i < 999; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(false);  // the 1000th clean step completes the window
  EXPECT_EQ(s.scale(), 131072.0);
}

TEST(LossScaler, WindowHysteresisAndBackoff) {
  LossScaler s(opts(8, 3, 2));
  run_script(s, {{'C', 8, 2}, {'C', 8, 2}, {'C', 16, 2},   // window of 3 doubles
                 {'O', 16, 1},                              // hysteresis absorbs one
                 {'O', 8, 1}, {'O', 4, 1},                  // then every overflow halves
                 {'C', 4, 1}, {'C', 4, 1}, {'C', 8, 2}});   // window since last overflow refills
  EXPECT_EQ(s.state().overflows, 3);
  EXPECT_EQ(s.state().last_overflow_iteration, 5);
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
