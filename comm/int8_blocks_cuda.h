// The 8-bit wires (Note [int8 blocks], comm/int8_blocks.h) on CUDA buffers, on a stream: the
// same wire, bit for bit, as the CPU encode_int8_blocks / encode_fp8_blocks (one arithmetic:
// Note [one 8-bit arithmetic], comm/eight_bit_math.h), so a device rank and a host rank
// exchange one format and every rank decodes the same values.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "comm/int8_blocks.h"

namespace zerort {

enum class EightBitCode { kInt8, kFp8E4m3 };

// x: n FP32 values on the device; wire: int8_wire_bytes(n, block) device bytes, 4-byte
// aligned. One CUDA block per block of codes: its largest magnitude (the first NaN by index
// wins, as the CPU's fold ends there), its scale, its codes. Checked launch.
void encode_8bit_blocks_cuda(EightBitCode code, const float* x, size_t n, void* wire, size_t block,
                             cudaStream_t stream);
// x[i] = code_i * scale of its block, in FP32.
void decode_8bit_blocks_cuda(EightBitCode code, const void* wire, size_t n, float* x, size_t block,
                             cudaStream_t stream);
// wires: `world` wires of n values, each int8_wire_bytes(n, block) bytes, wire r from rank r.
// out[i] (+)= the sum over r = 0..world-1 in that order of the decoded values, accumulated in
// FP64 and rounded once to FP32: the CPU's decode then sum_chunks_to_f32, bit for bit.
void sum_8bit_wires_to_f32_cuda(EightBitCode code, const void* wires, size_t world, size_t n, size_t block, float* out,
                                bool accumulate, cudaStream_t stream);

}  // namespace zerort
