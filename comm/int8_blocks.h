// The 8-bit wires of the two-hop reduce-scatter's second hop and of stage 3's weight gathers:
// FP32 values in blocks, each carried as 8-bit codes and one FP32 scale (comm.inter_node_dtype
// int8 or fp8_e4m3, Note [two hops]; stage3.gather_dtype int8).
#pragma once

#include <cstddef>

namespace zerort {

// Note [int8 blocks]
// x is cut into blocks of kInt8Block elements (the last may be shorter). A block's scale is
// s = a / 127 with a = max |x_i| over the block, and x_i travels as q_i = round(x_i / s)
// (to nearest even, in FP32) in [-127, 127]; the receiver takes q_i * s (rounded to FP32).
// The master weights never pass through this: only the partial gradient sums do.
//   Error: |q_i s - x_i| <= a / 254 + 2^-22 a per element (half a step, plus the two FP32
//   roundings), so a block's error is relative to its largest element.
//   An all-zero block has s = 0 and sends zeros (as does a block with a < 127 * 2^-149, whose
//   s rounds to 0). A block holding a NaN or an infinity has a
//   non-finite a, sent as its scale with every code 0: each of its values arrives as NaN, so
//   the step's non-finite check sees it on every rank (never a silent finite value).
// fp8_e4m3 is the same with s = a / 448 and q_i the e4m3 ("fn": bias 7, 3 mantissa bits, no
// infinity) nearest to x_i / s, ties to even: |q_i s - x_i| <= 2^-4 |x_i| + 2^-10 s + 2^-22 a
// (relative in the normal range, half a subnormal step of 2^-9 s below it).
// The wire: the n codes, zero-padded to a multiple of 4 bytes, then one FP32 scale per block:
// int8_wire_bytes(n) bytes, a multiple of 4 (so it travels as 32-bit words).
// kInt8Block: 256 elements, 4 bytes of scale per 256 codes (1.6%); bench/int8_wire.py measures
// the error of 64 to 4096 on the 50M GPT's gradients.
inline constexpr size_t kInt8Block = 256;

size_t int8_wire_bytes(size_t n, size_t block = kInt8Block);
void encode_int8_blocks(const float* x, size_t n, void* wire, size_t block = kInt8Block);
void decode_int8_blocks(const void* wire, size_t n, float* x, size_t block = kInt8Block);
void encode_fp8_blocks(const float* x, size_t n, void* wire, size_t block = kInt8Block);  // the same wire size
void decode_fp8_blocks(const void* wire, size_t n, float* x, size_t block = kInt8Block);

}  // namespace zerort
