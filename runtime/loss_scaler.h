// LossScaler: dynamic (FP16) or static (BF16: scale 1) loss scaling, DeepSpeed's rules.
// Every rank feeds it the same global overflow flag, so every rank holds the same scale.
#pragma once

#include <cstdint>

namespace zerort {

struct LossScalerOptions {
  bool dynamic = true;
  double initial_scale = 65536.0;  // 2^16; the static scale when dynamic = false
  int64_t window = 1000;           // clean steps (after the first one) before the scale doubles
  int64_t hysteresis = 2;          // overflows tolerated before the scale halves
  double min_scale = 1.0;
  double factor = 2.0;
  bool consecutive_hysteresis = false;  // a clean step refills the hysteresis
};

class LossScaler {
 public:
  struct State {
    double scale = 1.0;
    int64_t hysteresis_left = 0;
    int64_t iteration = 0;  // updates so far
    int64_t last_overflow_iteration = -1;
    int64_t overflows = 0;  // skipped steps so far
  };

  explicit LossScaler(LossScalerOptions options = {});

  double scale() const { return state_.scale; }
  const State& state() const { return state_; }
  const LossScalerOptions& options() const { return options_; }

  // Applies one step's global outcome, as DeepSpeed >= 0.17.1's DynamicLossScaler does.
  // Overflow: with hysteresis left only decrements it, else halves the scale (not below
  // min_scale); an overflow when the scale already is min_scale and no hysteresis is left
  // throws zerort::Error naming the minimum and the step (1-based: the number of this
  // update). Clean: consecutive_hysteresis refills the hysteresis. The window counts clean
  // steps from the step after the last overflow: with stable = iteration (0-based, this
  // update's) - last_overflow_iteration (-1 before any) - 1, a clean step with stable > 0
  // and stable % window == 0 doubles the scale and refills the hysteresis. So the scale first
  // doubles on the (window + 1)-th clean step in a row, then every window clean steps:
  // from 2^8 with window 2, ten clean steps read 256, 256, 512, 512, 1024, 1024, 2048,
  // 2048, 4096, 4096. The static scaler never changes its scale.
  void update(bool overflow);

  // Checkpoint support; load checks the state is valid for these options.
  void load_state(const State& state);

 private:
  LossScalerOptions options_;
  State state_;
};

}  // namespace zerort
