#include "optim/adamw_bf16_master.h"

#include "core/error.h"
#include "optim/adamw_math.h"
#include "optim/parallel_for.h"

namespace zerort {

namespace {

// out_mode: 0 none, 1 bf16 bits, 2 f32.
template <typename G, typename S, bool FromGrad>
void bf16_master_loop(const AdamWCoeffs c, float unscale, const G* __restrict g, uint16_t* __restrict p,
                      S* __restrict m, S* __restrict v, void* out, int out_mode, size_t n) {
  uint16_t* __restrict lp = static_cast<uint16_t*>(out);
  float* __restrict wp = static_cast<float*>(out);
  for (size_t i = 0; i < n; ++i) {
    uint16_t pi = p[i];
    float mi = load_as_float(m, i), vi = load_as_float(v, i);
    adamw_bf16_master_element<FromGrad>(c, unscale, load_as_float(g, i), pi, mi, vi);
    p[i] = pi;
    store_from_float(m, i, mi);
    store_from_float(v, i, vi);
    if (out_mode == 1) lp[i] = pi;
    if (out_mode == 2) wp[i] = bf16_to_f32(pi);
  }
}

template <typename G, typename S>
void bf16_master_run(const AdamWBuffers& b, const AdamWCoeffs& c) {
  const int out_mode = !b.param ? 0 : b.param_dtype == DType::kBFloat16 ? 1 : 2;
  const size_t psize = b.param ? dtype_size(b.param_dtype) : 0;
  parallel_for(b.n, size_t{1} << 16, [&](size_t, size_t lo, size_t hi) {
    void* out = b.param ? static_cast<char*>(b.param) + lo * psize : nullptr;
    const G* g = static_cast<const G*>(b.grad) + lo;
    S* m = static_cast<S*>(b.exp_avg) + lo;
    S* v = static_cast<S*>(b.exp_avg_sq) + lo;
    if (c.lerp_from_grad)
      bf16_master_loop<G, S, true>(c, b.grad_unscale, g, b.master_bf16 + lo, m, v, out, out_mode, hi - lo);
    else
      bf16_master_loop<G, S, false>(c, b.grad_unscale, g, b.master_bf16 + lo, m, v, out, out_mode, hi - lo);
  });
}

}  // namespace

AdamWBuffers bf16_master_buffers(const void* grad, DType grad_dtype, uint16_t* master, void* exp_avg, void* exp_avg_sq,
                                 DType state_dtype, size_t n) {
  AdamWBuffers b;
  b.grad = grad;
  b.grad_dtype = grad_dtype;
  b.master = nullptr;
  b.master_bf16 = master;
  b.exp_avg = exp_avg;
  b.exp_avg_sq = exp_avg_sq;
  b.state_dtype = state_dtype;
  b.n = n;
  return b;
}

void check_bf16_master_buffers(const AdamWBuffers& b, const AdamWStep& s, const char* who) {
  ZRT_CHECK(b.grad_dtype == DType::kFloat32 || b.grad_dtype == DType::kBFloat16, who,
            ": gradient dtype must be f32 or bf16, got ", dtype_name(b.grad_dtype));
  ZRT_CHECK(b.state_dtype == DType::kFloat32 || b.state_dtype == DType::kBFloat16, who,
            ": optimizer state dtype must be f32 or bf16, got ", dtype_name(b.state_dtype));
  ZRT_CHECK(!b.param || b.param_dtype == DType::kBFloat16 || b.param_dtype == DType::kFloat32, who,
            ": with a bf16 master the parameter output must be bf16 or f32, got ", dtype_name(b.param_dtype));
  ZRT_CHECK(b.master == nullptr, who, ": set master_bf16 alone, not also the FP32 master");
  ZRT_CHECK(b.n == 0 || (b.grad && b.master_bf16 && b.exp_avg && b.exp_avg_sq), who,
            ": null gradient, master_bf16, exp_avg or exp_avg_sq buffer for ", b.n, " elements");
  ZRT_CHECK(s.step >= 1, who, ": step count must be >= 1, got ", s.step);
  check_adamw_hyper(s.hyper, who);
}

void adamw_step_bf16_master(const AdamWBuffers& b, const AdamWStep& s) {
  check_bf16_master_buffers(b, s, "adamw_step_bf16_master");
  const AdamWCoeffs c = AdamWCoeffs::from(s);
  const bool g16 = b.grad_dtype == DType::kBFloat16, s16 = b.state_dtype == DType::kBFloat16;
  if (g16 && s16) return bf16_master_run<uint16_t, uint16_t>(b, c);
  if (g16) return bf16_master_run<uint16_t, float>(b, c);
  if (s16) return bf16_master_run<float, uint16_t>(b, c);
  bf16_master_run<float, float>(b, c);
}

}  // namespace zerort
