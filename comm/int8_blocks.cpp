// The 8-bit wires: See Note [int8 blocks] (int8_blocks.h).
#include "comm/int8_blocks.h"

#include <cstdint>
#include <cstring>

#include "comm/eight_bit_math.h"
#include "core/error.h"

namespace zerort {

namespace {

using eight_bit::blocks_of;
using eight_bit::codes_bytes;
using eight_bit::Fp8Code;
using eight_bit::Int8Code;

template <typename Code>
void encode_blocks(const float* x, size_t n, void* wire, size_t block, const char* what) {
  ZRT_CHECK(block > 0, what, ": a block holds at least one element");
  auto* codes = static_cast<uint8_t*>(wire);
  char* scales = static_cast<char*>(wire) + codes_bytes(n);
  std::memset(codes + n, 0, codes_bytes(n) - n);
  for (size_t b = 0, lo = 0; lo < n; ++b, lo += block) {
    const size_t hi = lo + block < n ? lo + block : n;
    float a = 0;
    for (size_t i = lo; i < hi && !eight_bit::is_nan(a); ++i) a = eight_bit::fold_abs_max(a, x[i]);
    const float scale = eight_bit::block_scale(a, Code::kMax);  // Note [one 8-bit arithmetic]
    for (size_t i = lo; i < hi; ++i) codes[i] = eight_bit::encode_value<Code>(x[i], a, scale);
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
    for (size_t i = lo; i < hi; ++i) x[i] = eight_bit::decode_value<Code>(codes[i], scale);
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
