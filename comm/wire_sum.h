// The sum of partial FP32 sums over a communicator, each partial carried on a chosen wire, and
// the all-gather of sums on it: the two-hop reduce-scatter's second hop (Note [two hops]) and the
// sum of a gradient shard across replica groups (Note [hybrid sharding], runtime/shard_groups.h).
#pragma once

#include <cstddef>
#include <string>

#include "comm/communicator.h"

namespace zerort {

// The partial sums' form on the wire (comm.inter_node_dtype): fp32 (no rounding), bf16 (rounded
// to nearest even), or int8 or fp8_e4m3 (blocks of codes with an FP32 scale each: Note [int8
// blocks], comm/int8_blocks.h).
enum class InterNodeWire { kFp32, kBf16, kInt8, kFp8 };
// "fp32", "bf16", "int8" or "fp8_e4m3"; a ConfigError naming the key otherwise.
InterNodeWire parse_inter_node_wire(const std::string& name);
size_t inter_node_wire_bytes(InterNodeWire wire, size_t n);  // one partial of n elements on it
// A collective moves one partial of n values as inter_node_wire_count elements of
// inter_node_wire_type: 8-bit wires as opaque 32-bit words (int8_wire_bytes is a multiple of 4).
size_t inter_node_wire_count(InterNodeWire wire, size_t n);
DType inter_node_wire_type(InterNodeWire wire);
bool is_eight_bit(InterNodeWire wire);

// parts: comm.size() partials of n FP32 values, partial k for rank k. Each travels on `wire`
// (an all-to-all, waited for on this thread); out (n values) becomes the sum of the partials
// this rank received, in rank order 0..size-1, decoded to FP32 and summed in FP64, rounded once
// (added to out with accumulate). Bitwise the same on every run.
void sum_over_wire(Communicator& comm, const float* parts, size_t n, InterNodeWire wire, float* out, bool accumulate);

// out (comm.size() x n FP32 values) gets rank k's `mine` at k n, as it arrives over `wire`: every
// rank's values encoded on it and decoded on every rank, this rank's own too, so all ranks hold
// the same bits (fp32: exactly `mine`). An all-gather, waited for on this thread; tag: what it serves.
void gather_over_wire(Communicator& comm, const float* mine, size_t n, InterNodeWire wire, float* out, int64_t tag);

}  // namespace zerort
