// LoCo kernels for the CPU, and the schemas of the loco:: operators.
//
// quantize_ef             fused error feedback + quantization of a gradient (sender side)
// dequant_reduce_requant  sum of S quantized rows + error feedback + requantization (2nd hop)
// dequant_reduce          sum of S quantized rows / divisor, written into `out` (receiver side)
//
// Every kernel works one quantization group at a time: a group is loaded into a small float
// array, and each step is a plain loop over it that the compiler vectorizes (built with
// -O3, the CPU's vector ISA and -ffp-contract=off so no multiply-add is fused: the results are
// bitwise those of loco/reference.py).  Groups are spread over threads with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "loco_common.h"

namespace loco {
namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float -> bfloat16, round to nearest even (as c10::BFloat16 and torch's .to(torch.bfloat16))
inline uint16_t to_bf16(float f) {
  uint32_t u = bits_of(f);
  if ((u & kAbsMask) > kInfBits) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

#if defined(__FLT16_MAX__)
inline float from_f16(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, sizeof v);
  return static_cast<float>(v);
}
inline uint16_t to_f16(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, sizeof h);
  return h;
}
#else
inline float from_f16(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
inline uint16_t to_f16(float f) { return c10::Half(f).x; }
#endif

// ---- one group at a time --------------------------------------------------------------------

template <int DT>
inline void load_run(const void* src, int64_t off, int64_t n, float* __restrict d) {
  if constexpr (DT == kF32) {
    const float* __restrict s = static_cast<const float*>(src) + off;
    for (int64_t i = 0; i < n; ++i) d[i] = s[i];
  } else if constexpr (DT == kBF16) {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(src) + off;
    for (int64_t i = 0; i < n; ++i) d[i] = from_bf16(s[i]);
  } else {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(src) + off;
    for (int64_t i = 0; i < n; ++i) d[i] = from_f16(s[i]);
  }
}

template <int DT>
inline void store_run(void* dst, int64_t off, int64_t n, const float* __restrict v) {
  if constexpr (DT == kF32) {
    float* __restrict d = static_cast<float*>(dst) + off;
    for (int64_t i = 0; i < n; ++i) d[i] = v[i];
  } else if constexpr (DT == kBF16) {
    uint16_t* __restrict d = static_cast<uint16_t*>(dst) + off;
    for (int64_t i = 0; i < n; ++i) d[i] = to_bf16(v[i]);
  } else {
    uint16_t* __restrict d = static_cast<uint16_t*>(dst) + off;
    for (int64_t i = 0; i < n; ++i) d[i] = to_f16(v[i]);
  }
}

// Float codes of x[0..G) into c; returns the scale.
inline float codes_of(const float* __restrict x, int64_t G, float qmax, float* __restrict c) {
  uint32_t m = 0;
  for (int64_t i = 0; i < G; ++i) {
    const uint32_t a = bits_of(x[i]) & kAbsMask;
    m = a > m ? a : m;
  }
  if (m >= kInfBits) {  // inf or NaN: codes 0, scale inf, so deQ is non-finite
    for (int64_t i = 0; i < G; ++i) c[i] = 0.f;
    return std::numeric_limits<float>::infinity();
  }
  float scale = 0.f, inv = 0.f;
  if (m >= kTinyBits) {
    const float amax = from_bits(m);
    scale = amax / qmax;
    inv = qmax / amax;
  }
  const float lo = -qmax;
  for (int64_t i = 0; i < G; ++i) {
    float v = std::nearbyint(x[i] * inv);
    v = v < lo ? lo : v;
    v = v > qmax ? qmax : v;
    c[i] = v;
  }
  return scale;
}

template <int BITS>
inline void pack(const float* __restrict c, int64_t G, uint8_t* __restrict q) {
  if constexpr (BITS == 4) {
    for (int64_t j = 0; j < G / 2; ++j) {
      const int lo = static_cast<int>(c[2 * j]) + 8;
      const int hi = static_cast<int>(c[2 * j + 1]) + 8;
      q[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  } else {
    int8_t* __restrict d = reinterpret_cast<int8_t*>(q);
    for (int64_t i = 0; i < G; ++i) d[i] = static_cast<int8_t>(static_cast<int>(c[i]));
  }
}

template <int BITS>
inline void unpack(const uint8_t* __restrict q, int64_t G, float* __restrict c) {
  if constexpr (BITS == 4) {
    for (int64_t j = 0; j < G / 2; ++j) {
      c[2 * j] = static_cast<float>(static_cast<int>(q[j] & 15) - 8);
      c[2 * j + 1] = static_cast<float>(static_cast<int>(q[j] >> 4) - 8);
    }
  } else {
    const int8_t* __restrict s = reinterpret_cast<const int8_t*>(q);
    for (int64_t i = 0; i < G; ++i) c[i] = static_cast<float>(s[i]);
  }
}

struct Err {
  int kind = kErrNone;
  const void* in = nullptr;
  const float* in_scale = nullptr;
  void* out = nullptr;
  float* out_scale = nullptr;
};

inline void load_err(const Err& e, int64_t gi, int64_t G, float* __restrict ep) {
  const int64_t off = gi * G;
  if (e.kind == kErrInt8) {
    const int8_t* __restrict s = static_cast<const int8_t*>(e.in) + off;
    const float sc = e.in_scale[gi];
    for (int64_t i = 0; i < G; ++i) ep[i] = static_cast<float>(s[i]) * sc;
  } else if (e.kind == kErrBF16) {
    load_run<kBF16>(e.in, off, G, ep);
  } else {
    load_run<kF32>(e.in, off, G, ep);
  }
}

inline void store_err(const Err& e, int64_t gi, int64_t G, const float* __restrict en, float* __restrict tmp) {
  const int64_t off = gi * G;
  if (e.kind == kErrInt8) {
    e.out_scale[gi] = codes_of(en, G, 127.f, tmp);
    pack<8>(tmp, G, static_cast<uint8_t*>(e.out) + off);
  } else if (e.kind == kErrBF16) {
    store_run<kBF16>(e.out, off, G, en);
  } else {
    store_run<kF32>(e.out, off, G, en);
  }
}

// x holds the group (g + e); quantize it, write codes and scale, update the error.
template <int BITS>
inline void encode_group(const float* __restrict x, const float* __restrict ep, int64_t gi, int64_t G,
                         float b, float omb, uint8_t* __restrict q, float* __restrict scale, const Err& e,
                         float* __restrict c, float* __restrict en) {
  constexpr float qmax = BITS == 4 ? 7.f : 127.f;
  const float s = codes_of(x, G, qmax, c);
  scale[gi] = s;
  pack<BITS>(c, G, q + gi * G * BITS / 8);
  if (e.kind == kErrNone) return;
  for (int64_t i = 0; i < G; ++i) {
    const float r = x[i] - c[i] * s;
    en[i] = b * ep[i] + omb * r;
  }
  store_err(e, gi, G, en, c);
}

// acc[0..G) = sum over rows s of deQ(q[s], group gi), rows added in order.
template <int BITS>
inline void reduce_group(const uint8_t* q, int64_t q_stride, const float* sc, int64_t sc_stride, int64_t S,
                         int64_t gi, int64_t G, float* __restrict acc, float* __restrict c) {
  for (int64_t i = 0; i < G; ++i) acc[i] = 0.f;
  for (int64_t s = 0; s < S; ++s) {
    unpack<BITS>(q + s * q_stride + gi * G * BITS / 8, G, c);
    const float f = sc[s * sc_stride + gi];
    for (int64_t i = 0; i < G; ++i) acc[i] = acc[i] + c[i] * f;
  }
}

// ---- checks and allocation ---------------------------------------------------------------------

void check_params(int64_t bits, int64_t G) {
  TORCH_CHECK(bits == 4 || bits == 8, "loco: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(G >= 64 && G <= kMaxGroup && (G & (G - 1)) == 0,
              "loco: group_size must be a power of two in [64, 1024], got ", G);
}

int dtype_code(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: TORCH_CHECK(false, "loco: ", what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return kF32;
}

// Validates the error buffer of `total` elements and allocates the output error buffers.
Err make_err(const at::Tensor& e, const at::Tensor& e_scale, int64_t total, int64_t G, at::Tensor& e_out,
             at::Tensor& es_out) {
  Err err;
  const auto f32 = e.options().dtype(at::kFloat);
  es_out = at::empty({0}, f32);
  if (e.numel() == 0) {
    e_out = at::empty({0}, e.options());
    return err;
  }
  TORCH_CHECK(e.numel() == total && e.is_contiguous(), "loco: error buffer must be contiguous with ", total,
              " elements, got ", e.numel());
  switch (e.scalar_type()) {
    case at::kChar:
      err.kind = kErrInt8;
      TORCH_CHECK(e_scale.scalar_type() == at::kFloat && e_scale.numel() == total / G && e_scale.is_contiguous(),
                  "loco: an int8 error buffer needs ", total / G, " contiguous float32 scales");
      err.in_scale = e_scale.data_ptr<float>();
      es_out = at::empty({total / G}, f32);
      err.out_scale = es_out.data_ptr<float>();
      break;
    case at::kBFloat16: err.kind = kErrBF16; break;
    case at::kFloat: err.kind = kErrF32; break;
    default: TORCH_CHECK(false, "loco: error buffer must be int8, bfloat16 or float32, got ", e.scalar_type());
  }
  e_out = at::empty({total}, e.options());
  err.in = e.data_ptr();
  err.out = e_out.data_ptr();
  return err;
}

void check_rows(const at::Tensor& q, const at::Tensor& scale, int64_t bits, int64_t G, int64_t& M) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && (q.size(1) <= 1 || q.stride(1) == 1),
              "loco: q must be a 2-D uint8 tensor [sources, bytes] with contiguous rows");
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && (scale.size(1) <= 1 || scale.stride(1) == 1),
              "loco: scale must be a 2-D float32 tensor [sources, groups] with contiguous rows");
  M = q.size(1) * 8 / bits;
  TORCH_CHECK(M % G == 0 && scale.size(0) == q.size(0) && scale.size(1) == M / G,
              "loco: q holds ", M, " elements per row, which needs ", M / G, " scales per row; got ",
              scale.sizes());
}

inline int64_t grain(int64_t G) { return std::max<int64_t>(1, 32768 / G); }

// ---- operators ---------------------------------------------------------------------------------

template <int DT, int BITS>
void quantize_ef_impl(const void* g, int64_t n, int64_t row_len, int64_t cpad, int64_t ngroups, int64_t G,
                      float b, float omb, uint8_t* q, float* scale, const Err& err) {
  const int64_t gpr = cpad / G;
  at::parallel_for(0, ngroups, grain(G), [&](int64_t begin, int64_t end) {
    alignas(64) float x[kMaxGroup], ep[kMaxGroup], c[kMaxGroup], en[kMaxGroup];
    for (int64_t gi = begin; gi < end; ++gi) {
      const int64_t r = gi / gpr, j = gi - r * gpr;
      const int64_t start = r * row_len + j * G;
      const int64_t row_valid = std::min(row_len, std::max<int64_t>(0, n - r * row_len));
      const int64_t valid = std::min(G, std::max<int64_t>(0, row_valid - j * G));
      load_run<DT>(g, start, valid, x);
      for (int64_t i = valid; i < G; ++i) x[i] = 0.f;
      if (err.kind != kErrNone) {
        load_err(err, gi, G, ep);
        for (int64_t i = 0; i < G; ++i) x[i] = x[i] + ep[i];
      }
      encode_group<BITS>(x, ep, gi, G, b, omb, q, scale, err, c, en);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_ef_cpu(
    const at::Tensor& g_in, const at::Tensor& e, const at::Tensor& e_scale, double beta, int64_t bits,
    int64_t group_size, int64_t row_len, int64_t nrows) {
  check_params(bits, group_size);
  const int64_t G = group_size;
  const at::Tensor g = g_in.contiguous();
  const int64_t n = g.numel();
  TORCH_CHECK(row_len >= 0 && nrows >= 0 && n <= row_len * nrows, "loco: ", n, " elements do not fit ", nrows,
              " rows of ", row_len);
  const int64_t cpad = (row_len + G - 1) / G * G;
  const int64_t total = cpad * nrows, ngroups = total / G;
  const int dt = dtype_code(g, "g");
  auto q = at::empty({total * bits / 8}, g.options().dtype(at::kByte));
  auto scale = at::empty({ngroups}, g.options().dtype(at::kFloat));
  at::Tensor e_out, es_out;
  const Err err = make_err(e, e_scale, total, G, e_out, es_out);
  const float b = static_cast<float>(beta), omb = static_cast<float>(1.0 - beta);
  const void* gp = g.data_ptr();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
#define LOCO_QEF(DT, BITS) quantize_ef_impl<DT, BITS>(gp, n, row_len, cpad, ngroups, G, b, omb, qp, sp, err)
  if (bits == 4) {
    if (dt == kF32) LOCO_QEF(kF32, 4); else if (dt == kBF16) LOCO_QEF(kBF16, 4); else LOCO_QEF(kF16, 4);
  } else {
    if (dt == kF32) LOCO_QEF(kF32, 8); else if (dt == kBF16) LOCO_QEF(kBF16, 8); else LOCO_QEF(kF16, 8);
  }
#undef LOCO_QEF
  return {q, scale, e_out, es_out};
}

template <int BITS>
void drr_impl(const at::Tensor& q, const at::Tensor& scale, int64_t M, int64_t G, float b, float omb, uint8_t* q2,
              float* s2, const Err& err) {
  const int64_t S = q.size(0), ngroups = M / G;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t qs = q.stride(0), ss = scale.stride(0);
  at::parallel_for(0, ngroups, grain(G), [&](int64_t begin, int64_t end) {
    alignas(64) float x[kMaxGroup], ep[kMaxGroup], c[kMaxGroup], en[kMaxGroup];
    for (int64_t gi = begin; gi < end; ++gi) {
      reduce_group<BITS>(qp, qs, sp, ss, S, gi, G, x, c);
      if (err.kind != kErrNone) {
        load_err(err, gi, G, ep);
        for (int64_t i = 0; i < G; ++i) x[i] = x[i] + ep[i];
      }
      encode_group<BITS>(x, ep, gi, G, b, omb, q2, s2, err, c, en);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dequant_reduce_requant_cpu(
    const at::Tensor& q, const at::Tensor& scale, const at::Tensor& e, const at::Tensor& e_scale, double beta,
    int64_t bits, int64_t group_size) {
  check_params(bits, group_size);
  int64_t M = 0;
  check_rows(q, scale, bits, group_size, M);
  auto q2 = at::empty({M * bits / 8}, q.options());
  auto s2 = at::empty({M / group_size}, scale.options());
  at::Tensor e_out, es_out;
  const Err err = make_err(e, e_scale, M, group_size, e_out, es_out);
  const float b = static_cast<float>(beta), omb = static_cast<float>(1.0 - beta);
  if (bits == 4)
    drr_impl<4>(q, scale, M, group_size, b, omb, q2.data_ptr<uint8_t>(), s2.data_ptr<float>(), err);
  else
    drr_impl<8>(q, scale, M, group_size, b, omb, q2.data_ptr<uint8_t>(), s2.data_ptr<float>(), err);
  return {q2, s2, e_out, es_out};
}

template <int DT, int BITS>
void dr_impl(const at::Tensor& q, const at::Tensor& scale, int64_t G, float divisor, void* out, int64_t n_out) {
  const int64_t S = q.size(0), ngroups = (n_out + G - 1) / G;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t qs = q.stride(0), ss = scale.stride(0);
  at::parallel_for(0, ngroups, grain(G), [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxGroup], c[kMaxGroup];
    for (int64_t gi = begin; gi < end; ++gi) {
      reduce_group<BITS>(qp, qs, sp, ss, S, gi, G, acc, c);
      if (divisor != 1.f)
        for (int64_t i = 0; i < G; ++i) acc[i] = acc[i] / divisor;
      store_run<DT>(out, gi * G, std::min(G, n_out - gi * G), acc);
    }
  });
}

void dequant_reduce_cpu(const at::Tensor& q, const at::Tensor& scale, int64_t bits, int64_t group_size,
                        double divisor, const at::Tensor& out) {
  check_params(bits, group_size);
  int64_t M = 0;
  check_rows(q, scale, bits, group_size, M);
  TORCH_CHECK(out.is_contiguous() && out.numel() <= M, "loco: out must be contiguous with at most ", M,
              " elements, got ", out.numel());
  const int dt = dtype_code(out, "out");
  const float d = static_cast<float>(divisor);
  void* op = out.data_ptr();
  const int64_t n = out.numel();
  if (n == 0) return;
#define LOCO_DR(DT, BITS) dr_impl<DT, BITS>(q, scale, group_size, d, op, n)
  if (bits == 4) {
    if (dt == kF32) LOCO_DR(kF32, 4); else if (dt == kBF16) LOCO_DR(kBF16, 4); else LOCO_DR(kF16, 4);
  } else {
    if (dt == kF32) LOCO_DR(kF32, 8); else if (dt == kBF16) LOCO_DR(kBF16, 8); else LOCO_DR(kF16, 8);
  }
#undef LOCO_DR
}

}  // namespace
}  // namespace loco

TORCH_LIBRARY(loco, m) {
  m.def(
      "quantize_ef(Tensor g, Tensor e, Tensor e_scale, float beta, int bits, int group_size, int row_len, "
      "int nrows) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "dequant_reduce_requant(Tensor q, Tensor scale, Tensor e, Tensor e_scale, float beta, int bits, "
      "int group_size) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("dequant_reduce(Tensor q, Tensor scale, int bits, int group_size, float divisor, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(loco, CPU, m) {
  m.impl("quantize_ef", &loco::quantize_ef_cpu);
  m.impl("dequant_reduce_requant", &loco::dequant_reduce_requant_cpu);
  m.impl("dequant_reduce", &loco::dequant_reduce_cpu);
}
