// IEEE single operations on host and device, each rounded to nearest even on its own and never
// fused with another: the device's intrinsics (which nvcc never contracts), the host's plain
// operators (the CPU build does not contract them). The AdamW update (optim/adamw_math.h) and
// the 8-bit wires (comm/eight_bit_math.h) are written in them, so CPU and CUDA give the same bits.
#pragma once

#include <cmath>

#include "core/half.h"  // ZRT_HD

namespace zerort {

ZRT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ZRT_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
ZRT_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
ZRT_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
ZRT_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return sqrtf(a);
#endif
}
ZRT_HD float fma_rn(float a, float b, float c) {  // a*b + c, rounded once
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return fmaf(a, b, c);
#endif
}

}  // namespace zerort
