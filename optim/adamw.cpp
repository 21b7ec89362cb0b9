#include "optim/adamw.h"

#include <cmath>
#include <limits>
#include <type_traits>

#include "core/error.h"
#include "optim/adamw_math.h"
#include "optim/parallel_for.h"

namespace zerort {

namespace {

// Narrowing of the written parameter, as a compile-time choice.
enum class Out { kNone, kBf16, kF16, kF32 };

template <typename G, typename S, Out O, bool FromGrad>
__attribute__((always_inline)) inline void adamw_loop(const AdamWCoeffs& coeffs, const G* __restrict g,
                                                      float* __restrict p, S* __restrict m, S* __restrict v, void* out,
                                                      size_t n) {
  const AdamWCoeffs c = coeffs;  // a local copy: no aliasing with the float streams
  uint16_t* __restrict lp = static_cast<uint16_t*>(out);
  float* __restrict wp = static_cast<float*>(out);
  for (size_t i = 0; i < n; ++i) {
    const float gi = load_as_float(g, i);
    float pi = p[i], mi = load_as_float(m, i), vi = load_as_float(v, i);
    adamw_element<FromGrad>(c, gi, pi, mi, vi);
    p[i] = pi;
    store_from_float(m, i, mi);
    store_from_float(v, i, vi);
    if constexpr (O == Out::kBf16) lp[i] = f32_to_bf16(pi);
    if constexpr (O == Out::kF16) lp[i] = f32_to_f16(pi);
    if constexpr (O == Out::kF32) wp[i] = pi;
  }
}

template <typename G, typename S, Out O>
__attribute__((always_inline)) inline void adamw_body(const AdamWCoeffs& c, const G* g, float* p, S* m, S* v, void* lp,
                                                      size_t n) {
  if (c.lerp_from_grad)
    adamw_loop<G, S, O, true>(c, g, p, m, v, lp, n);
  else
    adamw_loop<G, S, O, false>(c, g, p, m, v, lp, n);
}

// Each kernel is built for three x86-64 levels: x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA)
// and the baseline (SSE2; fmaf is then glibc's correctly rounded fmaf); one is picked at run
// time from CPUID. All three round each operation of adamw_element on its own (-ffp-contract=off,
// the fused multiply-adds are the explicit fmaf), so all give the same bits, and the CUDA
// kernel's (optim/adamw_math.h). Named adamw_<grad>_<states>_<param out>_<level>.
#if defined(__x86_64__)
#define ZRT_ADAMW_TARGET_V4 __attribute__((target("arch=x86-64-v4")))
#define ZRT_ADAMW_TARGET_V3 __attribute__((target("arch=x86-64-v3")))
#else  // one portable build: every level is the baseline
#define ZRT_ADAMW_TARGET_V4
#define ZRT_ADAMW_TARGET_V3
#endif
#define ZRT_ADAMW_LEVEL(name, G, S, O, attr)                                                   \
  attr void name(const AdamWCoeffs& c, const G* g, float* p, S* m, S* v, void* lp, size_t n) { \
    adamw_body<G, S, O>(c, g, p, m, v, lp, n);                                                 \
  }
#define ZRT_ADAMW_VARIANT(name, G, S, O)                   \
  ZRT_ADAMW_LEVEL(name##_v4, G, S, O, ZRT_ADAMW_TARGET_V4) \
  ZRT_ADAMW_LEVEL(name##_v3, G, S, O, ZRT_ADAMW_TARGET_V3) \
  ZRT_ADAMW_LEVEL(name##_v1, G, S, O, )
#define ZRT_ADAMW_OUTS(prefix, G, S)                 \
  ZRT_ADAMW_VARIANT(prefix##_none, G, S, Out::kNone) \
  ZRT_ADAMW_VARIANT(prefix##_bf16, G, S, Out::kBf16) \
  ZRT_ADAMW_VARIANT(prefix##_f16, G, S, Out::kF16)   \
  ZRT_ADAMW_VARIANT(prefix##_f32, G, S, Out::kF32)
ZRT_ADAMW_OUTS(adamw_f32_f32, float, float)
ZRT_ADAMW_OUTS(adamw_bf16_f32, uint16_t, float)
ZRT_ADAMW_OUTS(adamw_f32_bf16, float, uint16_t)
ZRT_ADAMW_OUTS(adamw_bf16_bf16, uint16_t, uint16_t)
#undef ZRT_ADAMW_OUTS
#undef ZRT_ADAMW_VARIANT
#undef ZRT_ADAMW_LEVEL

using Kernel = void (*)(const AdamWCoeffs&, const void*, float*, void*, void*, void*, size_t);

template <typename G, typename S>
Kernel erase(void (*k)(const AdamWCoeffs&, const G*, float*, S*, S*, void*, size_t)) {  // the dtypes, erased
  return reinterpret_cast<Kernel>(k);
}

// The 16 kernels of one level, by [gradient is bf16][states are bf16][Out].
using Level = Kernel[2][2][4];
#define ZRT_ADAMW_OUTS(prefix, sfx) \
  { erase(prefix##_none_##sfx), erase(prefix##_bf16_##sfx), erase(prefix##_f16_##sfx), erase(prefix##_f32_##sfx) }
#define ZRT_ADAMW_LEVEL(sfx)                                                     \
  {                                                                              \
    {ZRT_ADAMW_OUTS(adamw_f32_f32, sfx), ZRT_ADAMW_OUTS(adamw_f32_bf16, sfx)}, { \
      ZRT_ADAMW_OUTS(adamw_bf16_f32, sfx), ZRT_ADAMW_OUTS(adamw_bf16_bf16, sfx)  \
    }                                                                            \
  }
const Level kLevels[3] = {ZRT_ADAMW_LEVEL(v1), ZRT_ADAMW_LEVEL(v3), ZRT_ADAMW_LEVEL(v4)};  // by CpuIsa
#undef ZRT_ADAMW_LEVEL
#undef ZRT_ADAMW_OUTS

Kernel pick(DType grad, DType state, DType param, bool write_param, CpuIsa isa) {
  const Out out = !write_param                ? Out::kNone
                  : param == DType::kBFloat16 ? Out::kBf16
                  : param == DType::kFloat32  ? Out::kF32
                                              : Out::kF16;
  return kLevels[static_cast<int>(isa)][grad == DType::kBFloat16][state == DType::kBFloat16][static_cast<int>(out)];
}

CpuIsa detect_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return CpuIsa::kAvx512;
  if (__builtin_cpu_supports("x86-64-v3")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kBaseline;
}

void run_adamw(const AdamWBuffers& b, const AdamWStep& s, CpuIsa isa);

}  // namespace

void check_adamw_hyper(const AdamWHyper& h, const char* who) {
  ZRT_CHECK_AS(ConfigError, h.beta1 >= 0 && h.beta1 < 1 && h.beta2 >= 0 && h.beta2 < 1, who,
               ": betas must be in [0, 1), got (", h.beta1, ", ", h.beta2, ")");
  ZRT_CHECK_AS(ConfigError, std::isfinite(h.lr) && h.lr >= 0 && std::isfinite(h.weight_decay) && h.weight_decay >= 0,
               who, ": lr (", h.lr, ") and weight_decay (", h.weight_decay, ") must be finite numbers >= 0");
  // The kernels compute in FP32: an eps that is 0 or subnormal there is 0 / 0 = NaN where a
  // gradient and its moments are 0, and an lr past FP32's range is inf.
  ZRT_CHECK_AS(ConfigError, std::isfinite(h.eps) && static_cast<float>(h.eps) >= std::numeric_limits<float>::min(), who,
               ": eps must be a finite number >= ", std::numeric_limits<float>::min(),
               " (FP32's smallest normal "
               "number; e.g. 1e-8), got ",
               h.eps,
               "; with eps = 0 in FP32 a gradient and moments of 0 give the update "
               "0 / 0 = NaN");
  ZRT_CHECK_AS(ConfigError,
               std::isfinite(static_cast<float>(h.lr)) && std::isfinite(static_cast<float>(h.weight_decay)), who,
               ": lr (", h.lr, ") and weight_decay (", h.weight_decay,
               ") must be finite in FP32 (<= ", std::numeric_limits<float>::max(), ")");
}

CpuIsa adamw_cpu_isa() {
  static const CpuIsa best = detect_isa();
  return best;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "x86-64-v4 (AVX-512)";
    case CpuIsa::kAvx2: return "x86-64-v3 (AVX2+FMA)";
    case CpuIsa::kBaseline: return "x86-64 baseline";
  }
  return "unknown level";
}

namespace {

// p moved on by `bytes`; nullptr stays nullptr.
template <typename T>
T* advanced(T* p, size_t bytes) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return p ? reinterpret_cast<T*>(reinterpret_cast<Byte*>(p) + bytes) : p;
}

}  // namespace

AdamWBuffers elements_of(const AdamWBuffers& b, size_t skip, size_t n) {
  AdamWBuffers out = b;
  out.grad = advanced(b.grad, skip * dtype_size(b.grad_dtype));
  out.master = advanced(b.master, skip * sizeof(float));
  out.master_bf16 = advanced(b.master_bf16, skip * sizeof(uint16_t));
  out.exp_avg = advanced(b.exp_avg, skip * dtype_size(b.state_dtype));
  out.exp_avg_sq = advanced(b.exp_avg_sq, skip * dtype_size(b.state_dtype));
  out.param = advanced(b.param, skip * dtype_size(b.param_dtype));
  out.n = n;
  return out;
}

void adamw_step(const AdamWBuffers& b, const AdamWStep& s) { run_adamw(b, s, adamw_cpu_isa()); }

void adamw_step_isa(const AdamWBuffers& b, const AdamWStep& s, CpuIsa isa) {
  ZRT_CHECK(static_cast<int>(isa) >= 0 && static_cast<int>(isa) <= static_cast<int>(adamw_cpu_isa()),
            "adamw_step_isa: this CPU does not run the ", cpu_isa_name(isa), " kernel (it runs up to ",
            cpu_isa_name(adamw_cpu_isa()), ")");
  run_adamw(b, s, isa);
}

namespace {

void run_adamw(const AdamWBuffers& b, const AdamWStep& s, CpuIsa isa) {
  ZRT_CHECK(b.grad_dtype == DType::kFloat32 || b.grad_dtype == DType::kBFloat16,
            "adamw_step: gradient dtype must be f32 or bf16, got ", dtype_name(b.grad_dtype));
  ZRT_CHECK(!b.param || b.param_dtype == DType::kBFloat16 || b.param_dtype == DType::kFloat16 ||
                b.param_dtype == DType::kFloat32,
            "adamw_step: parameter dtype must be bf16, f16 or f32, got ", dtype_name(b.param_dtype));
  ZRT_CHECK(b.n == 0 || (b.grad && b.master && b.exp_avg && b.exp_avg_sq),
            "adamw_step: null gradient, master, exp_avg or exp_avg_sq buffer for ", b.n, " elements");
  ZRT_CHECK(b.state_dtype == DType::kFloat32 || b.state_dtype == DType::kBFloat16,
            "adamw_step: optimizer state dtype must be f32 or bf16, got ", dtype_name(b.state_dtype));
  ZRT_CHECK(s.step >= 1, "adamw_step: step count must be >= 1, got ", s.step);
  check_adamw_hyper(s.hyper, "adamw_step");
  const AdamWCoeffs c = AdamWCoeffs::from(s);
  const Kernel kernel = pick(b.grad_dtype, b.state_dtype, b.param_dtype, b.param != nullptr, isa);
  const size_t gsize = dtype_size(b.grad_dtype);
  const size_t ssize = dtype_size(b.state_dtype);
  const size_t psize = b.param ? dtype_size(b.param_dtype) : 0;
  parallel_for(b.n, size_t{1} << 16, [&](size_t, size_t lo, size_t hi) {
    void* lp = b.param ? static_cast<char*>(b.param) + lo * psize : nullptr;
    kernel(c, static_cast<const char*>(b.grad) + lo * gsize, b.master + lo, static_cast<char*>(b.exp_avg) + lo * ssize,
           static_cast<char*>(b.exp_avg_sq) + lo * ssize, lp, hi - lo);
  });
}

}  // namespace

}  // namespace zerort
