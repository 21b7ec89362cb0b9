#include "runtime/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace zerort {

LossScaler::LossScaler(LossScalerOptions o) : options_(o) {
  ZRT_CHECK_AS(ConfigError, std::isfinite(o.initial_scale) && o.initial_scale > 0,
               "loss_scale.initial_scale must be a positive finite number, got ", o.initial_scale);
  if (o.dynamic) {
    ZRT_CHECK_AS(ConfigError, o.window >= 1, "loss_scale.window must be >= 1, got ", o.window);
    ZRT_CHECK_AS(ConfigError, o.hysteresis >= 1, "loss_scale.hysteresis must be >= 1, got ", o.hysteresis);
    ZRT_CHECK_AS(ConfigError, o.min_scale > 0 && o.min_scale <= o.initial_scale, "loss_scale.min_scale must be in (0, ",
                 "initial_scale=", o.initial_scale, "], got ", o.min_scale);
    ZRT_CHECK_AS(ConfigError, o.factor > 1, "loss_scale.factor must be > 1, got ", o.factor);
  }
  state_.scale = o.initial_scale;
  state_.hysteresis_left = o.hysteresis;
}

void LossScaler::update(bool overflow) {
  State& s = state_;
  if (overflow) ++s.overflows;
  if (!options_.dynamic) {
    ++s.iteration;
    return;
  }
  if (overflow) {
    if (s.hysteresis_left <= 1) {
      ZRT_CHECK_AS(LossScaleError, s.scale > options_.min_scale, "gradients overflowed at step ", s.iteration + 1,
                   " with the loss scale already at its minimum ", options_.min_scale,
                   " (loss_scale.min_scale); the model produces non-finite gradients at any scale. "
                   "Lower the learning rate, check the data, or use bf16");
      s.scale = std::max(s.scale / options_.factor, options_.min_scale);
    } else {
      --s.hysteresis_left;
    }
    s.last_overflow_iteration = s.iteration;
  } else {
    if (options_.consecutive_hysteresis) s.hysteresis_left = options_.hysteresis;
    // DeepSpeed >= 0.17.1 (PR #6976): stable is 0 on the first clean step after an overflow
    // (and on the first step of training), so the scale first doubles on the
    // (window + 1)-th clean step in a row, then every window clean steps.
    const int64_t stable = s.iteration - s.last_overflow_iteration - 1;
    if (stable > 0 && stable % options_.window == 0) {
      s.hysteresis_left = options_.hysteresis;
      s.scale *= options_.factor;
    }
  }
  ++s.iteration;
}

void LossScaler::load_state(const State& st) {
  ZRT_CHECK(std::isfinite(st.scale) && st.scale > 0, "loss scaler state: scale must be positive, got ", st.scale);
  ZRT_CHECK(st.iteration >= 0 && st.last_overflow_iteration >= -1 && st.last_overflow_iteration < st.iteration + 1 &&
                st.hysteresis_left >= 0,
            "loss scaler state is inconsistent (iteration ", st.iteration, ", last overflow ",
            st.last_overflow_iteration, ", hysteresis left ", st.hysteresis_left, ")");
  state_ = st;
}

}  // namespace zerort
