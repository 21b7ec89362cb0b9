// The int8 wire: See Note [int8 blocks] (int8_blocks.h).
#include "comm/int8_blocks.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/error.h"

namespace zerort {

namespace {

size_t blocks_of(size_t n, size_t block) { return (n + block - 1) / block; }
size_t codes_bytes(size_t n) { return (n + 3) / 4 * 4; }

}  // namespace

size_t int8_wire_bytes(size_t n, size_t block) {
  ZRT_CHECK(block > 0, "int8_wire_bytes: a block holds at least one element");
  return codes_bytes(n) + blocks_of(n, block) * sizeof(float);
}

void encode_int8_blocks(const float* x, size_t n, void* wire, size_t block) {
  ZRT_CHECK(block > 0, "encode_int8_blocks: a block holds at least one element");
  auto* codes = static_cast<int8_t*>(wire);
  char* scales = static_cast<char*>(wire) + codes_bytes(n);
  std::memset(codes + n, 0, codes_bytes(n) - n);
  for (size_t b = 0, lo = 0; lo < n; ++b, lo += block) {
    const size_t hi = lo + block < n ? lo + block : n;
    float a = 0;
    for (size_t i = lo; i < hi && !std::isnan(a); ++i) {
      const float m = std::fabs(x[i]);
      if (!(m <= a)) a = m;  // a NaN is taken (it is not <= anything), and ends the search
    }
    float scale = a / 127.0f;
    if (!std::isfinite(a)) {
      scale = a;  // NaN or infinity: codes 0, each value arrives as 0 * scale = NaN
      std::memset(codes + lo, 0, hi - lo);
    } else {
      for (size_t i = lo; i < hi; ++i) {
        // |x / scale| <= 127; a below 127 subnormals (scale 0) sends zeros
        codes[i] = scale == 0 ? 0 : static_cast<int8_t>(std::nearbyint(x[i] / scale));
      }
    }
    std::memcpy(scales + b * sizeof(float), &scale, sizeof(float));
  }
}

void decode_int8_blocks(const void* wire, size_t n, float* x, size_t block) {
  ZRT_CHECK(block > 0, "decode_int8_blocks: a block holds at least one element");
  const auto* codes = static_cast<const int8_t*>(wire);
  const char* scales = static_cast<const char*>(wire) + codes_bytes(n);
  for (size_t b = 0, lo = 0; lo < n; ++b, lo += block) {
    float scale;
    std::memcpy(&scale, scales + b * sizeof(float), sizeof(float));
    const size_t hi = lo + block < n ? lo + block : n;
    for (size_t i = lo; i < hi; ++i) x[i] = static_cast<float>(codes[i]) * scale;
  }
}

}  // namespace zerort
