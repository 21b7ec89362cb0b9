// The AdamW element update shared by the CPU and CUDA kernels. Operation order follows
// torch.optim.AdamW (single-tensor path) in float:
//   p *= 1 - lr*wd;  m = lerp(m, g, 1-b1);  v = fma((1-b2)*g, g, v*b2);
//   denom = sqrt(v)/sqrt(bc2) + eps;  p += (-lr/bc1 * m) / denom
// lerp and addcmul use one fused multiply-add each, as torch's vectorized CPU kernels do
// (checked against torch 2.13 on AVX-512).
//
// One arithmetic on CPU and CUDA: every other operation is rounded on its own. nvcc contracts
// a*b + c into one FMA by default (-fmad=true) while the CPU build does not (-ffp-contract=off
// in optim/CMakeLists.txt), so on the device each operation is written as the intrinsic that
// rounds it (__fmul_rn, __fadd_rn, ..., which nvcc never contracts) and the two FMAs as fmaf.
// The CPU kernels (every ISA level) and the CUDA kernel then give the same bits:
// test_optim_kernels.cpp checks the CPU against a scalar reference in this order.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/half.h"
#include "core/rounded_ops.h"
#include "optim/adamw.h"

namespace zerort {

// Float scalars of one step, derived once in double on the host as torch derives them.
struct AdamWCoeffs {
  float decay;          // 1 - lr*wd
  float lerp_coeff;     // w = 1 - beta1 when |w| < 0.5, else w - 1 (torch's two lerp forms)
  bool lerp_from_grad;  // |w| >= 0.5: m = g + (w - 1)(g - m), else m = m + w(g - m)
  float beta2;
  float one_minus_b2;  // 1 - beta2
  float bc2_sqrt;      // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float grad_multiplier;

  static AdamWCoeffs from(const AdamWStep& s) {
    const AdamWHyper& h = s.hyper;
    const double step = static_cast<double>(s.step);
    const double lr = h.lr, b1 = h.beta1, b2 = h.beta2;
    AdamWCoeffs c;
    c.decay = static_cast<float>(1.0 - lr * h.weight_decay);
    const float w = static_cast<float>(1.0 - b1);
    c.lerp_from_grad = !(std::fabs(w) < 0.5f);
    c.lerp_coeff = c.lerp_from_grad ? w - 1.0f : w;
    c.beta2 = static_cast<float>(h.beta2);
    c.one_minus_b2 = static_cast<float>(1.0 - b2);
    c.bc2_sqrt = h.bias_correction ? static_cast<float>(std::sqrt(1.0 - std::pow(b2, step))) : 1.0f;
    c.eps = static_cast<float>(h.eps);
    c.neg_step_size = static_cast<float>(-(h.bias_correction ? lr / (1.0 - std::pow(b1, step)) : lr));
    c.grad_multiplier = s.grad_multiplier;
    return c;
  }
};

// One element: updates p, m, v in place from gradient g (already a float). FromGrad is
// c.lerp_from_grad, hoisted out of the loop so that the loop has no select to vectorise.
template <bool FromGrad>
ZRT_HD void adamw_element(const AdamWCoeffs c, float g, float& p, float& m, float& v) {
  g = mul_rn(g, c.grad_multiplier);
  p = mul_rn(p, c.decay);
  m = fma_rn(c.lerp_coeff, sub_rn(g, m), FromGrad ? g : m);
  v = fma_rn(mul_rn(c.one_minus_b2, g), g, mul_rn(v, c.beta2));  // torch: v.mul_(b2).addcmul_(g, g, 1-b2), fused
  const float denom = add_rn(div_rn(sqrt_rn(v), c.bc2_sqrt), c.eps);
  p = add_rn(p, div_rn(mul_rn(c.neg_step_size, m), denom));
}

// An element of a 2-byte T is bf16 bits, of a 4-byte T a float: read as float, stored rounded
// to nearest even (the kernels' master, moments and gradient).
template <typename T>
ZRT_HD float load_as_float(const T* x, size_t i) {
  if constexpr (sizeof(T) == 2)
    return bf16_to_f32(x[i]);
  else
    return x[i];
}

template <typename T>
ZRT_HD void store_from_float(T* x, size_t i, float value) {
  if constexpr (sizeof(T) == 2)
    x[i] = f32_to_bf16(value);
  else
    x[i] = value;
}

// One element of a bf16 master (optim/adamw_bf16_master.h): g times unscale in float, then
// adamw_element in FP32 on the master read from its bf16 bits; the new master is rounded to
// nearest even once, on store. m and v stay float here; the caller stores them in their dtype.
template <bool FromGrad>
ZRT_HD void adamw_bf16_master_element(const AdamWCoeffs c, float unscale, float g, uint16_t& p, float& m, float& v) {
  float pf = bf16_to_f32(p);
  adamw_element<FromGrad>(c, mul_rn(g, unscale), pf, m, v);
  p = f32_to_bf16(pf);
}

}  // namespace zerort
