#include "core/dtype.h"

#include "core/error.h"

namespace zerort {

bool is_valid(DType dtype) {
  auto v = static_cast<int32_t>(dtype);
  return v >= 0 && v <= static_cast<int32_t>(DType::kFloat16);
}

bool is_valid(ReduceOp op) {
  auto v = static_cast<int32_t>(op);
  return v >= 0 && v <= static_cast<int32_t>(ReduceOp::kMin);
}

bool is_low_precision(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
  }
  ZRT_THROW("unknown dtype value ", static_cast<int32_t>(dtype), "; expected one of f32, f64, i32, i64, bf16, f16");
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "f32";
    case DType::kFloat64: return "f64";
    case DType::kInt32: return "i32";
    case DType::kInt64: return "i64";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "f16";
  }
  return "unknown";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

DType parse_dtype(const std::string& name) {
  if (name == "f32" || name == "float32" || name == "fp32") return DType::kFloat32;
  if (name == "f64" || name == "float64" || name == "fp64") return DType::kFloat64;
  if (name == "i32" || name == "int32") return DType::kInt32;
  if (name == "i64" || name == "int64") return DType::kInt64;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "f16" || name == "float16" || name == "fp16") return DType::kFloat16;
  ZRT_THROW("unknown dtype '", name, "'; expected one of f32, f64, i32, i64, bf16, f16");
}

}  // namespace zerort
