#include "optim/cast.h"

#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "core/half.h"

namespace zerort {

void cast_from_f32(const float* in, void* out, DType out_dtype, size_t n) {
  auto* o = static_cast<uint16_t*>(out);
  switch (out_dtype) {
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) o[i] = f32_to_bf16(in[i]);
      return;
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) o[i] = f32_to_f16(in[i]);
      return;
    case DType::kFloat32:
      if (n) std::memmove(out, in, n * sizeof(float));
      return;
    default: ZRT_THROW("cast_from_f32: target dtype must be bf16, f16 or f32, got ", dtype_name(out_dtype));
  }
}

void cast_to_f32(const void* in, DType in_dtype, float* out, size_t n) {
  const auto* h = static_cast<const uint16_t*>(in);
  switch (in_dtype) {
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(h[i]);
      return;
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(h[i]);
      return;
    case DType::kFloat32:
      if (n) std::memmove(out, in, n * sizeof(float));
      return;
    default: ZRT_THROW("cast_to_f32: source dtype must be bf16, f16 or f32, got ", dtype_name(in_dtype));
  }
}

}  // namespace zerort
