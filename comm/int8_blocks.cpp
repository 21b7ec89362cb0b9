// The 8-bit wires: See Note [int8 blocks] (int8_blocks.h).
#include "comm/int8_blocks.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/error.h"

namespace zerort {

namespace {

size_t blocks_of(size_t n, size_t block) { return (n + block - 1) / block; }
size_t codes_bytes(size_t n) { return (n + 3) / 4 * 4; }

// int8: codes -127..127 of steps a / 127.
struct Int8Code {
  static constexpr float kMax = 127.0f;
  static uint8_t encode(float y) { return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y))); }
  static float decode(uint8_t c) { return static_cast<float>(static_cast<int8_t>(c)); }
};

// fp8 e4m3 (OCP "fn": 4 exponent bits of bias 7, 3 mantissa bits, no infinity, largest 448).
// The positive codes 0x00..0x7e are increasing in value, so a code is the nearest entry of
// that table, a tie going to the even code (its mantissa's last bit 0): round to nearest even.
struct Fp8Code {
  static constexpr float kMax = 448.0f;
  static const std::array<float, 127>& positives() {
    static const std::array<float, 127> table = [] {
      std::array<float, 127> t{};
      for (int c = 0; c < 127; ++c) {
        const int e = c >> 3, m = c & 7;
        t[static_cast<size_t>(c)] = e == 0 ? std::ldexp(static_cast<float>(m), -9)  // subnormals: m * 2^-9
                                           : std::ldexp(1.0f + static_cast<float>(m) / 8, e - 7);
      }
      return t;
    }();
    return table;
  }
  static uint8_t encode(float y) {
    const auto& t = positives();
    const float v = std::fabs(y);
    size_t hi = static_cast<size_t>(std::lower_bound(t.begin(), t.end(), v) - t.begin());
    size_t c;
    if (hi == 0) {
      c = 0;
    } else if (hi == t.size()) {
      c = t.size() - 1;  // |y| <= 448 by the scale; only rounding can pass it
    } else {
      const double below = double{v} - t[hi - 1], above = double{t[hi]} - v;  // exact
      c = below < above ? hi - 1 : above < below ? hi : ((hi - 1) % 2 == 0 ? hi - 1 : hi);
    }
    return static_cast<uint8_t>(c | (std::signbit(y) && c != 0 ? 0x80 : 0));
  }
  static float decode(uint8_t c) {
    const float v = positives()[c & 0x7f];  // 0x7f (NaN) is never sent
    return (c & 0x80) ? -v : v;
  }
};

template <typename Code>
void encode_blocks(const float* x, size_t n, void* wire, size_t block, const char* what) {
  ZRT_CHECK(block > 0, what, ": a block holds at least one element");
  auto* codes = static_cast<uint8_t*>(wire);
  char* scales = static_cast<char*>(wire) + codes_bytes(n);
  std::memset(codes + n, 0, codes_bytes(n) - n);
  for (size_t b = 0, lo = 0; lo < n; ++b, lo += block) {
    const size_t hi = lo + block < n ? lo + block : n;
    float a = 0;
    for (size_t i = lo; i < hi && !std::isnan(a); ++i) {
      const float m = std::fabs(x[i]);
      if (!(m <= a)) a = m;  // a NaN is taken (it is not <= anything), and ends the search
    }
    float scale = a / Code::kMax;
    if (!std::isfinite(a)) scale = a;  // NaN or infinity: codes 0, each value arrives as 0 * scale = NaN
    for (size_t i = lo; i < hi; ++i) {
      // |x / scale| <= kMax; a below kMax subnormals (scale 0) sends zeros
      codes[i] = !std::isfinite(a) || scale == 0 ? 0 : Code::encode(x[i] / scale);
    }
    std::memcpy(scales + b * sizeof(float), &scale, sizeof(float));
  }
}

template <typename Code>
void decode_blocks(const void* wire, size_t n, float* x, size_t block, const char* what) {
  ZRT_CHECK(block > 0, what, ": a block holds at least one element");
  const auto* codes = static_cast<const uint8_t*>(wire);
  const char* scales = static_cast<const char*>(wire) + codes_bytes(n);
  for (size_t b = 0, lo = 0; lo < n; ++b, lo += block) {
    float scale;
    std::memcpy(&scale, scales + b * sizeof(float), sizeof(float));
    const size_t hi = lo + block < n ? lo + block : n;
    for (size_t i = lo; i < hi; ++i) x[i] = Code::decode(codes[i]) * scale;
  }
}

}  // namespace

size_t int8_wire_bytes(size_t n, size_t block) {
  ZRT_CHECK(block > 0, "int8_wire_bytes: a block holds at least one element");
  return codes_bytes(n) + blocks_of(n, block) * sizeof(float);
}

void encode_int8_blocks(const float* x, size_t n, void* wire, size_t block) {
  encode_blocks<Int8Code>(x, n, wire, block, "encode_int8_blocks");
}
void decode_int8_blocks(const void* wire, size_t n, float* x, size_t block) {
  decode_blocks<Int8Code>(wire, n, x, block, "decode_int8_blocks");
}
void encode_fp8_blocks(const float* x, size_t n, void* wire, size_t block) {
  encode_blocks<Fp8Code>(x, n, wire, block, "encode_fp8_blocks");
}
void decode_fp8_blocks(const void* wire, size_t n, float* x, size_t block) {
  decode_blocks<Fp8Code>(wire, n, x, block, "decode_fp8_blocks");
}

}  // namespace zerort
