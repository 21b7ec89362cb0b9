// Element types the comm, partition and optim layers understand (no torch here).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace zerort {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kInt32 = 2,
  kInt64 = 3,
  kBFloat16 = 4,
  kFloat16 = 5,
};

enum class ReduceOp : int32_t { kSum = 0, kMax = 1, kMin = 2 };

// True for the six values above; false for anything cast from an unknown integer.
bool is_valid(DType dtype);
bool is_valid(ReduceOp op);
bool is_low_precision(DType dtype);  // bf16 or f16

// Bytes per element. Throws zerort::Error naming the value for an unknown dtype.
size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // "f32", "bf16", ... or "unknown"
const char* reduce_op_name(ReduceOp op);

// Parses "f32"/"float32", "bf16"/"bfloat16", ...; the error lists the accepted names.
DType parse_dtype(const std::string& name);

}  // namespace zerort
