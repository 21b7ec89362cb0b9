// The per-element arithmetic of the 8-bit wires (Note [int8 blocks], comm/int8_blocks.h), one
// definition shared by the CPU code (comm/int8_blocks.cpp) and the CUDA kernels
// (comm/int8_blocks_cuda.cu): the block's largest magnitude, its scale, each code's rounding
// and each value's decode. So the two give the same bits (Note [one 8-bit arithmetic]).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/half.h"  // ZRT_HD, f32_from_bits
#include "core/rounded_ops.h"

namespace zerort {
namespace eight_bit {

// Note [one 8-bit arithmetic]
// Every operation here is one IEEE operation rounded to nearest even, written so that nvcc
// neither contracts nor approximates it: the division and product as div_rn / mul_rn
// (core/rounded_ops.h: __fdiv_rn / __fmul_rn on the device, the host's own / and *), rint for the int8 code (ties
// to even on both), and the e4m3 table computed from its bits (exact). The one difference left
// is the bits of a NaN that a block with a NaN or an infinity decodes to: the host keeps the
// NaN operand's payload, the device gives its canonical NaN; both are NaN in every place.
// (div_rn and mul_rn: core/rounded_ops.h.)

// Sign, magnitude and finiteness from the bits (what std::fabs, std::signbit, std::isfinite
// compute), and rint: the same calls on host and device.
ZRT_HD float abs_of(float x) { return f32_from_bits(f32_bits(x) & 0x7fffffffu); }
ZRT_HD bool negative(float x) { return (f32_bits(x) >> 31) != 0; }
ZRT_HD bool finite(float x) { return (f32_bits(x) & 0x7f800000u) != 0x7f800000u; }
ZRT_HD bool is_nan(float x) { return (f32_bits(x) & 0x7fffffffu) > 0x7f800000u; }
ZRT_HD float rint_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // the default rounding mode: to nearest even
#endif
}

inline constexpr size_t codes_bytes(size_t n) { return (n + 3) / 4 * 4; }  // the codes, padded to 4 bytes
inline constexpr size_t blocks_of(size_t n, size_t block) { return (n + block - 1) / block; }

// The running largest magnitude of a block, in index order: a NaN is taken (it is not <=
// anything), and the first NaN ends the fold (the device takes the first NaN by index).
ZRT_HD float fold_abs_max(float a, float x) {
  const float m = abs_of(x);
  return m <= a ? a : m;
}
// The block's scale from its largest magnitude a: a / max_code, or a itself when a is not
// finite (then every code is 0 and each value arrives as 0 * a = NaN).
ZRT_HD float block_scale(float a, float max_code) { return finite(a) ? div_rn(a, max_code) : a; }

// int8: codes -127..127 of steps a / 127.
struct Int8Code {
  static constexpr float kMax = 127.0f;
  ZRT_HD static uint8_t encode(float y) { return static_cast<uint8_t>(static_cast<int8_t>(rint_even(y))); }
  ZRT_HD static float decode(uint8_t c) { return static_cast<float>(static_cast<int8_t>(c)); }
};

// fp8 e4m3 (OCP "fn": 4 exponent bits of bias 7, 3 mantissa bits, no infinity, largest 448).
// The positive codes 0x00..0x7e are increasing in value, so a code is the nearest of them, a
// tie going to the even code (its mantissa's last bit 0): round to nearest even.
struct Fp8Code {
  static constexpr float kMax = 448.0f;
  static constexpr int kPositives = 127;  // codes 0x00..0x7e; 0x7f (NaN) is never sent
  // Code c's value, exact: subnormals m * 2^-9, normals (1 + m/8) 2^(e-7) from their FP32 bits.
  ZRT_HD static float positive(int c) {
    const int e = c >> 3, m = c & 7;
    if (e == 0) return static_cast<float>(m) * 0.001953125f;  // 2^-9: exact
    return f32_from_bits(static_cast<uint32_t>(e - 7 + 127) << 23 | static_cast<uint32_t>(m) << 20);
  }
  ZRT_HD static uint8_t encode(float y) {
    const float v = abs_of(y);
    int lo = 0, hi = kPositives;  // the first code whose value is not below v (a lower bound)
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (positive(mid) < v) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    int c;
    if (lo == 0) {
      c = 0;
    } else if (lo == kPositives) {
      c = kPositives - 1;  // |y| <= 448 by the scale; only rounding can pass it
    } else {
      const double below = static_cast<double>(v) - positive(lo - 1);  // exact in FP64
      const double above = static_cast<double>(positive(lo)) - v;
      c = below < above ? lo - 1 : above < below ? lo : ((lo - 1) % 2 == 0 ? lo - 1 : lo);
    }
    return static_cast<uint8_t>(c | (negative(y) && c != 0 ? 0x80 : 0));
  }
  ZRT_HD static float decode(uint8_t c) {
    const float v = positive(c & 0x7f);
    return (c & 0x80) ? -v : v;
  }
};

// One value's code in a block of largest magnitude a and scale s: |x / s| <= kMax; a block
// below kMax subnormals (s rounds to 0) or not finite sends zeros.
template <typename Code>
ZRT_HD uint8_t encode_value(float x, float a, float scale) {
  return !finite(a) || scale == 0 ? 0 : Code::encode(div_rn(x, scale));
}
template <typename Code>
ZRT_HD float decode_value(uint8_t code, float scale) {
  return mul_rn(Code::decode(code), scale);
}

}  // namespace eight_bit
}  // namespace zerort
