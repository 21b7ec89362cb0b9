#include "comm/wire_sum.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "comm/int8_blocks.h"
#include "comm/local_reduce.h"
#include "core/error.h"
#include "core/half.h"

namespace zerort {

namespace {

bool eight_bit(InterNodeWire wire) { return wire == InterNodeWire::kInt8 || wire == InterNodeWire::kFp8; }
DType wire_dtype(InterNodeWire wire) { return wire == InterNodeWire::kBf16 ? DType::kBFloat16 : DType::kFloat32; }

void encode(InterNodeWire wire, const float* partial, size_t n, char* to) {
  if (wire == InterNodeWire::kInt8) {
    encode_int8_blocks(partial, n, to);
  } else if (wire == InterNodeWire::kFp8) {
    encode_fp8_blocks(partial, n, to);
  } else if (wire == InterNodeWire::kBf16) {
    auto* h = reinterpret_cast<uint16_t*>(to);
    for (size_t i = 0; i < n; ++i) h[i] = f32_to_bf16(partial[i]);
  } else {
    std::memcpy(to, partial, n * sizeof(float));
  }
}

// One value-set of n off the wire into FP32.
void decode(InterNodeWire wire, const char* from, size_t n, float* to) {
  if (wire == InterNodeWire::kInt8) {
    decode_int8_blocks(from, n, to);
  } else if (wire == InterNodeWire::kFp8) {
    decode_fp8_blocks(from, n, to);
  } else if (wire == InterNodeWire::kBf16) {
    const auto* h = reinterpret_cast<const uint16_t*>(from);
    for (size_t i = 0; i < n; ++i) to[i] = bf16_to_f32(h[i]);
  } else {
    std::memcpy(to, from, n * sizeof(float));
  }
}

size_t wire_count(InterNodeWire wire, size_t n) { return inter_node_wire_count(wire, n); }
DType wire_type(InterNodeWire wire) { return inter_node_wire_type(wire); }

}  // namespace

size_t inter_node_wire_count(InterNodeWire wire, size_t n) { return eight_bit(wire) ? int8_wire_bytes(n) / 4 : n; }
DType inter_node_wire_type(InterNodeWire wire) { return eight_bit(wire) ? DType::kInt32 : wire_dtype(wire); }
bool is_eight_bit(InterNodeWire wire) { return eight_bit(wire); }

InterNodeWire parse_inter_node_wire(const std::string& name) {
  if (name == "fp32") return InterNodeWire::kFp32;
  if (name == "bf16") return InterNodeWire::kBf16;
  if (name == "int8") return InterNodeWire::kInt8;
  if (name == "fp8_e4m3") return InterNodeWire::kFp8;
  ZRT_THROW_AS(ConfigError, "comm.inter_node_dtype: got '", name, "'; expected fp32, bf16, int8 or fp8_e4m3");
}

size_t inter_node_wire_bytes(InterNodeWire wire, size_t n) {
  if (eight_bit(wire)) return int8_wire_bytes(n);
  return n * (wire == InterNodeWire::kBf16 ? 2 : 4);
}

void sum_over_wire(Communicator& comm, const float* parts, size_t n, InterNodeWire wire, float* out, bool accumulate) {
  const size_t ranks = static_cast<size_t>(comm.size()), bytes = inter_node_wire_bytes(wire, n);
  std::vector<char> to(ranks * bytes + 1), from(ranks * bytes + 1);
  for (size_t k = 0; k < ranks; ++k) encode(wire, parts + k * n, n, to.data() + k * bytes);
  comm.all_to_all(to.data(), from.data(), wire_count(wire, n), wire_type(wire))->wait();
  if (!eight_bit(wire)) {
    sum_chunks_to_f32(from.data(), wire_dtype(wire), ranks, n, out, accumulate);
    return;
  }
  std::vector<float> decoded(ranks * n + 1);  // decoded to FP32, then summed as the others
  for (size_t k = 0; k < ranks; ++k) decode(wire, from.data() + k * bytes, n, decoded.data() + k * n);
  sum_chunks_to_f32(decoded.data(), DType::kFloat32, ranks, n, out, accumulate);
}

void gather_over_wire(Communicator& comm, const float* mine, size_t n, InterNodeWire wire, float* out, int64_t tag) {
  const size_t ranks = static_cast<size_t>(comm.size()), bytes = inter_node_wire_bytes(wire, n);
  std::vector<char> to(bytes + 1), from(ranks * bytes + 1);
  encode(wire, mine, n, to.data());
  comm.all_gather(to.data(), from.data(), wire_count(wire, n), wire_type(wire), tag)->wait();
  for (size_t k = 0; k < ranks; ++k) decode(wire, from.data() + k * bytes, n, out + k * n);
}

}  // namespace zerort
