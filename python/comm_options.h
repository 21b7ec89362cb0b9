// comm.timeout_s and comm.debug as CommOptions, checked: one place for every binding file.
#pragma once

#include <chrono>
#include <cstdint>

#include "comm/communicator.h"
#include "core/error.h"

namespace zerort {

inline CommOptions comm_options(double timeout_s, bool debug) {
  ZRT_CHECK_AS(ConfigError, timeout_s >= 1e-3 && timeout_s <= 1e9,
               "comm.timeout_s must be between 0.001 and 1e9 "
               "seconds, got ",
               timeout_s);
  CommOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
  o.debug = debug;
  return o;
}

}  // namespace zerort
