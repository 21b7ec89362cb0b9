// Bulk casts between FP32 and bf16/f16 on the CPU. Round to nearest even; NaN, Inf and
// subnormals behave as in core/half.h. Bitwise equal to torch's .to() for every non-NaN
// value (tests/python/test_cast.py checks all 65,536 patterns and 10^6 random floats).
#pragma once

#include <cstddef>

#include "core/dtype.h"

namespace zerort {

// out_dtype: bf16 or f16 (f32 copies). Errors name the dtype otherwise.
void cast_from_f32(const float* in, void* out, DType out_dtype, size_t n);
void cast_to_f32(const void* in, DType in_dtype, float* out, size_t n);

}  // namespace zerort
