#include "comm/local_reduce.h"

#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "core/half.h"

namespace zerort {

namespace {

template <typename T>
inline T apply(T a, T b, ReduceOp op) {
  if constexpr (std::is_floating_point_v<T>) {
    if (op != ReduceOp::kSum && (std::isnan(a) || std::isnan(b))) return std::isnan(a) ? a : b;
  }
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kMax: return a < b ? b : a;
    case ReduceOp::kMin: return b < a ? b : a;
  }
  return a;
}

template <typename T>
void reduce_typed(T* acc, const T* src, size_t n, ReduceOp op) {
  if (op == ReduceOp::kSum) {
    for (size_t i = 0; i < n; ++i) acc[i] = acc[i] + src[i];  // the hot case, vectorised
    return;
  }
  for (size_t i = 0; i < n; ++i) acc[i] = apply(acc[i], src[i], op);
}

template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
void reduce_half(uint16_t* acc, const uint16_t* src, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) acc[i] = Narrow(apply(Widen(acc[i]), Widen(src[i]), op));
}

inline float identity(float x) { return x; }

template <typename In, float (*Widen)(In)>
void sum_chunks_impl(const In* chunks, size_t world, size_t n, float* out, bool accumulate) {
  for (size_t i = 0; i < n; ++i) {
    double acc = accumulate ? static_cast<double>(out[i]) : 0.0;
    for (size_t r = 0; r < world; ++r) acc += static_cast<double>(Widen(chunks[r * n + i]));
    out[i] = static_cast<float>(acc);
  }
}

template <float (*Widen)(uint16_t)>
void sum_chunks(const uint16_t* chunks, size_t world, size_t n, float* out, bool accumulate) {
  sum_chunks_impl<uint16_t, Widen>(chunks, world, n, out, accumulate);
}

template <typename F>
void sum_chunks(const F* chunks, size_t world, size_t n, float* out, bool accumulate) {
  sum_chunks_impl<float, identity>(chunks, world, n, out, accumulate);
}

}  // namespace

void reduce_into(void* acc, const void* src, size_t n, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::kFloat32: return reduce_typed(static_cast<float*>(acc), static_cast<const float*>(src), n, op);
    case DType::kFloat64: return reduce_typed(static_cast<double*>(acc), static_cast<const double*>(src), n, op);
    case DType::kInt32: return reduce_typed(static_cast<int32_t*>(acc), static_cast<const int32_t*>(src), n, op);
    case DType::kInt64: return reduce_typed(static_cast<int64_t*>(acc), static_cast<const int64_t*>(src), n, op);
    case DType::kBFloat16:
      return reduce_half<bf16_to_f32, f32_to_bf16>(static_cast<uint16_t*>(acc), static_cast<const uint16_t*>(src), n,
                                                   op);
    case DType::kFloat16:
      return reduce_half<f16_to_f32, f32_to_f16>(static_cast<uint16_t*>(acc), static_cast<const uint16_t*>(src), n, op);
  }
  ZRT_THROW("reduce_into: unknown dtype value ", static_cast<int32_t>(dtype));
}

void sum_chunks_to_f32(const void* chunks, DType dtype, size_t world, size_t n, float* out, bool accumulate) {
  const auto* c = static_cast<const uint16_t*>(chunks);
  if (dtype == DType::kBFloat16) return sum_chunks<bf16_to_f32>(c, world, n, out, accumulate);
  if (dtype == DType::kFloat16) return sum_chunks<f16_to_f32>(c, world, n, out, accumulate);
  if (dtype == DType::kFloat32) return sum_chunks<float>(static_cast<const float*>(chunks), world, n, out, accumulate);
  ZRT_THROW("sum_chunks_to_f32: input dtype must be bf16, f16 or f32, got ", dtype_name(dtype));
}

}  // namespace zerort
