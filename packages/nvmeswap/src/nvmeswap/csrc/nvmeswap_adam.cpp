// The fused Adam/AdamW step of nvmeswap: one pass over a sub-group's fp32 master and moments that
// reads the gradient straight from DeepSpeed's 16-bit (or fp32) partition, so no fp32 gradient
// buffer of the sub-group's size is ever made.
//
// The arithmetic is torch.optim.Adam/AdamW's single-tensor CPU step, operation for operation, so
// the results are bitwise equal to DeepSpeed stepping torch's optimizer on the fp32 gradient:
//   g  = float(grad) * grad_scale                 DeepSpeed's unscale (grad.mul_(1/combined))
//   AdamW: p = p * float(1 - lr*wd)               param.mul_(1 - lr * weight_decay)
//   Adam:  g = fma(p, float(wd), g)               grad.add(param, alpha=weight_decay)
//   m  = |w| < 0.5 ? fma(w, g - m, m)             exp_avg.lerp_(grad, w = 1 - beta1)
//                  : fma(w - 1, g - m, g)
//   v  = fma(float(1-beta2) * g, g, v * beta2)    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, ...)
//   d  = sqrt(v) / float(sqrt(bc2)) + eps         (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   p  = p + (float(-step_size) * m) / d          param.addcdiv_(exp_avg, denom, value=-step_size)
// with every multiply and add rounded as torch's kernels round them: the fma's are where torch's
// vectorised AVX2/AVX-512 kernels use one (``fma`` true); its portable DEFAULT kernels round the
// product and the sum separately (``fma`` false); -ffp-contract=off keeps the others separate.
// nvmeswap.adam picks ``fma`` by checking the kernel against torch's own optimizer when it loads.  The square root is
// torch's own (at::sqrt_out on each block): torch's CPU sqrt is not always the IEEE one (MKL's
// vector math), and matching it is what keeps the step bitwise.
//
// Work is split into blocks of kBlock elements over at::parallel_for; each block's three phases
// run on data in L1/L2, so the master and moments are read and written once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 4096;

struct Coeffs {
  float grad_scale;
  bool has_decay;
  bool decoupled;
  float decay;  // AdamW: 1 - lr*wd; Adam: wd
  bool w_small;
  float w;       // 1 - beta1 (lerp weight)
  float w_m1;    // w - 1
  float beta2;
  float one_m_beta2;
  float bc2_sqrt;
  float eps;
  float neg_step;  // -lr / (1 - beta1^step)
};

template <typename G>
inline float grad_at(const G* g, int64_t i, float scale) {
  return static_cast<float>(g[i]) * scale;
}

// a*b + c as torch's kernels compute it: one rounding where its vectorised kernels use a fused
// multiply-add (AVX2/AVX-512 builds), two where they do not (the portable DEFAULT build)
template <bool FMA>
inline float madd(float a, float b, float c) {
  if constexpr (FMA) {
    return std::fma(a, b, c);
  } else {
    return a * b + c;  // -ffp-contract=off: two roundings
  }
}

// phase 1: gradient, weight decay, first and second moment (in place)
template <typename G, bool FMA>
void moments(float* __restrict p, float* __restrict m, float* __restrict v, const G* __restrict g,
             int64_t n, const Coeffs& c) {
  const float s = c.grad_scale, dec = c.decay, w = c.w, wm1 = c.w_m1, b2 = c.beta2, s2 = c.one_m_beta2;
  if (c.has_decay && c.decoupled) {
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] * dec;
  }
  const bool l2 = c.has_decay && !c.decoupled, small = c.w_small;
  const float coef = small ? w : wm1;  // torch's lerp: fma(w, g - m, m) or fma(w - 1, g - m, g)
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float gi = g ? grad_at(g, i, s) : 0.0f * s;
    if (l2) gi = madd<FMA>(p[i], dec, gi);
    const float mi = m[i];
    m[i] = madd<FMA>(coef, gi - mi, small ? mi : gi);
    v[i] = madd<FMA>(s2 * gi, gi, v[i] * b2);
  }
}

// phase 3: the parameter update from the moments and sqrt(v) (in ``root``)
void update(float* __restrict p, const float* __restrict m, const float* __restrict root, int64_t n,
            const Coeffs& c) {
  const float bc = c.bc2_sqrt, eps = c.eps, ns = c.neg_step;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float d = root[i] / bc + eps;
    p[i] = p[i] + (ns * m[i]) / d;
  }
}

template <typename G, bool FMA>
void run(float* p, float* m, float* v, const G* g, int64_t n, const Coeffs& c) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> root(static_cast<size_t>(kBlock));
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t off = b * kBlock, len = std::min(kBlock, n - off);
      moments<G, FMA>(p + off, m + off, v + off, g ? g + off : nullptr, len, c);
      at::Tensor src = at::from_blob(v + off, {len}, opts);
      at::Tensor dst = at::from_blob(root.data(), {len}, opts);
      at::sqrt_out(dst, src);  // torch's own sqrt, as exp_avg_sq.sqrt() computes it
      update(p + off, m + off, root.data(), len, c);
    }
  });
}

template <typename G>
void run_any(float* p, float* m, float* v, const G* g, int64_t n, const Coeffs& c, bool fma) {
  if (fma) {
    run<G, true>(p, m, v, g, n, c);
  } else {
    run<G, false>(p, m, v, g, n, c);
  }
}

void check_state(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "nvmeswap::adam_step_: ", name, " must be a contiguous float32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device(), t.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(t.numel() == n, "nvmeswap::adam_step_: ", name, " has ", t.numel(), " elements, param has ", n);
}

void adam_step_cpu(at::Tensor param, at::Tensor exp_avg, at::Tensor exp_avg_sq, const c10::optional<at::Tensor>& grad,
                   double grad_scale, double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool decoupled, double step, bool fma) {
  const int64_t n = param.numel();
  check_state(param, "param", n);
  check_state(exp_avg, "exp_avg", n);
  check_state(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(step >= 1, "nvmeswap::adam_step_: step must be >= 1 (the count after this step), got ", step);
  // the scalars exactly as torch's Python step computes them (doubles), then as its kernels cast them
  const double bc1 = 1 - std::pow(beta1, step);
  const double bc2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bc1;
  Coeffs c{};
  c.grad_scale = static_cast<float>(grad_scale);
  c.has_decay = weight_decay != 0;
  c.decoupled = decoupled;
  c.decay = static_cast<float>(decoupled ? 1 - lr * weight_decay : weight_decay);
  c.w = static_cast<float>(1 - beta1);
  c.w_small = std::abs(c.w) < 0.5f;
  c.w_m1 = c.w - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.one_m_beta2 = static_cast<float>(1 - beta2);
  c.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  c.eps = static_cast<float>(eps);
  c.neg_step = static_cast<float>(-step_size);
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  if (!grad.has_value()) {
    run_any<float>(p, m, v, nullptr, n, c, fma);
    return;
  }
  const at::Tensor& g = *grad;
  TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.numel() == n,
              "nvmeswap::adam_step_: grad must be a contiguous CPU tensor of ", n, " elements, got ", g.numel(),
              " on ", g.device());
  switch (g.scalar_type()) {
    case at::kBFloat16:
      run_any<c10::BFloat16>(p, m, v, g.data_ptr<c10::BFloat16>(), n, c, fma);
      break;
    case at::kHalf:
      run_any<c10::Half>(p, m, v, g.data_ptr<c10::Half>(), n, c, fma);
      break;
    case at::kFloat:
      run_any<float>(p, m, v, g.data_ptr<float>(), n, c, fma);
      break;
    default:
      TORCH_CHECK(false, "nvmeswap::adam_step_: grad must be bfloat16, float16 or float32, got ", g.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(nvmeswap, m) {
  m.def(
      "adam_step_(Tensor(a!) param, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor? grad, float grad_scale, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, float step, bool fma) -> ()");
}

TORCH_LIBRARY_IMPL(nvmeswap, CPU, m) { m.impl("adam_step_", &adam_step_cpu); }
