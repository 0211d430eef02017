// LoCo CUDA kernels: the arithmetic of loco/reference.py with one warp per quantization group.
//
// Lane `l` holds elements k*32 + l (k < G/32) of its warp's group in registers, so every load
// and store of the warp is coalesced, and the two codes of a packed 4-bit byte (elements j and
// j + G/2) sit in the same lane; the group's max |x| is a warp reduction on the bits of
// |x|.  Every float operation is an explicitly rounded intrinsic (__fmul_rn, __fadd_rn,
// __fsub_rn, __fdiv_rn), which the compiler never contracts into a multiply-add, and rintf
// rounds half to even: the same float32 operations, in the same order, as the CPU kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <cstdlib>
#include <cstring>

#include "loco_kernels.cuh"

namespace loco {
namespace cuda {
namespace {

constexpr int kWarp = 32;

__device__ __forceinline__ float load_elem(const void* p, int dtype, int64_t i) {
  if (dtype == kF32) return static_cast<const float*>(p)[i];
  if (dtype == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return __half2float(static_cast<const __half*>(p)[i]);
}

__device__ __forceinline__ void store_elem(void* p, int dtype, int64_t i, float v) {
  if (dtype == kF32)
    static_cast<float*>(p)[i] = v;
  else if (dtype == kBF16)
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  else
    static_cast<__half*>(p)[i] = __float2half_rn(v);
}

// max over aligned sets of W lanes (W a power of two <= 32; every lane of the warp takes part)
template <int W = kWarp>
__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) {
    const uint32_t w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// codes (float, integral) of the K values of this lane; returns the group's scale (the group
// spans W lanes)
template <int K, int W = kWarp>
__device__ __forceinline__ float codes_of(const float (&x)[K], float qmax, float (&c)[K]) {
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint32_t a = __float_as_uint(x[k]) & kAbsMask;
    m = a > m ? a : m;
  }
  m = warp_max<W>(m);
  if (m >= kInfBits) {
#pragma unroll
    for (int k = 0; k < K; ++k) c[k] = 0.f;
    return CUDART_INF_F;
  }
  float scale = 0.f, inv = 0.f;
  if (m >= kTinyBits) {
    const float amax = __uint_as_float(m);
    scale = __fdiv_rn(amax, qmax);
    inv = __fdiv_rn(qmax, amax);
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float v = rintf(__fmul_rn(x[k], inv));
    v = v < -qmax ? -qmax : v;
    v = v > qmax ? qmax : v;
    c[k] = v;
  }
  return scale;
}

// write the codes of group gi (element k*32 + lane of the group is c[k]); 4-bit: byte j of the
// group holds elements j and j + G/2, i.e. c[k] and c[k + K/2] of the same lane
template <int BITS, int K>
__device__ __forceinline__ void store_codes(const float (&c)[K], uint8_t* qg, int lane) {
  if (BITS == 8) {
#pragma unroll
    for (int k = 0; k < K; ++k) qg[k * kWarp + lane] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(c[k])));
  } else {
#pragma unroll
    for (int k = 0; k < K / 2; ++k) {
      const int lo = static_cast<int>(c[k]) + 8, hi = static_cast<int>(c[k + K / 2]) + 8;
      qg[k * kWarp + lane] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

template <int BITS, int K>
__device__ __forceinline__ float load_code(const uint8_t* row, int64_t gi, int k, int lane) {
  constexpr int G = K * kWarp;
  if (BITS == 8) return static_cast<float>(static_cast<int8_t>(row[gi * G + k * kWarp + lane]));
  const bool high = k >= K / 2;
  const uint8_t b = row[gi * (G / 2) + (high ? k - K / 2 : k) * kWarp + lane];
  return static_cast<float>(static_cast<int>(high ? (b >> 4) : (b & 15)) - 8);
}

__device__ __forceinline__ uint8_t* q_row(const Dest& d, int64_t r) {
  return d.q + (r / d.B) * d.q_stride0 + (r % d.B) * d.q_stride1;
}
__device__ __forceinline__ float* s_row(const Dest& d, int64_t r) {
  return d.scale + (r / d.B) * d.s_stride0 + (r % d.B) * d.s_stride1;
}

// The error group is read before any lane writes it back: every lane loads here, and the first
// write follows warp shuffles, which no lane passes before all lanes reach them.
template <int K>
__device__ __forceinline__ void load_err(const ErrBuf& e, int64_t gi, int lane, float (&ep)[K]) {
  constexpr int G = K * kWarp;
  const float sc = e.kind == kErrInt8 ? e.scale[gi] : 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t i = gi * G + k * kWarp + lane;
    if (e.kind == kErrInt8)
      ep[k] = __fmul_rn(static_cast<float>(static_cast<const int8_t*>(e.data)[i]), sc);
    else
      ep[k] = load_elem(e.data, e.kind == kErrBF16 ? kBF16 : kF32, i);
  }
}

// the new error of each value: beta * e + (1 - beta) * (x - code * scale)
template <int K>
__device__ __forceinline__ void new_error(const float (&x)[K], const float (&ep)[K], const float (&c)[K], float s,
                                          float b, float omb, float (&en)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const float r = __fsub_rn(x[k], __fmul_rn(c[k], s));
    en[k] = __fadd_rn(__fmul_rn(b, ep[k]), __fmul_rn(omb, r));
  }
}

// quantize the group held in x (ep: previous error), codes to qg and scale to *sg, new error
// into group gi of the error buffer
template <int BITS, int K>
__device__ __forceinline__ void encode_group(const float (&x)[K], const float (&ep)[K], int64_t gi, int lane,
                                             float b, float omb, uint8_t* qg, float* sg, const ErrBuf& e) {
  constexpr int G = K * kWarp;
  constexpr float qmax = BITS == 4 ? 7.f : 127.f;
  float c[K];
  const float s = codes_of<K>(x, qmax, c);
  if (lane == 0) *sg = s;
  store_codes<BITS, K>(c, qg, lane);
  if (e.kind == kErrNone) return;
  float en[K];
  new_error<K>(x, ep, c, s, b, omb, en);
  if (e.kind == kErrInt8) {
    float c8[K];
    const float s8 = codes_of<K>(en, 127.f, c8);
    if (lane == 0) e.scale[gi] = s8;
    store_codes<8, K>(c8, static_cast<uint8_t*>(e.data) + gi * G, lane);
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) store_elem(e.data, e.kind == kErrBF16 ? kBF16 : kF32, gi * G + k * kWarp + lane, en[k]);
  }
}

template <int BITS, int K>
__device__ __forceinline__ void reduce_group(const Rows& rows, int64_t gi, int lane, float (&acc)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = 0.f;
  for (int64_t s = 0; s < rows.S; ++s) {
    const uint8_t* row = rows.q + s * rows.q_stride;
    const float f = rows.scale[s * rows.s_stride + gi];
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] = __fadd_rn(acc[k], __fmul_rn(load_code<BITS, K>(row, gi, k, lane), f));
  }
}

template <int BITS, int K>
__global__ void quantize_ef_kernel(QefArgs a) {
  constexpr int G = K * kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (gi >= a.ngroups) return;  // whole warps leave together
  const int64_t gpr = a.cpad / G;
  const int64_t r = gi / gpr, j = gi - r * gpr;
  const int64_t row_valid = min(a.row_len, max(static_cast<int64_t>(0), a.n - r * a.row_len));
  const int64_t valid = min(static_cast<int64_t>(G), max(static_cast<int64_t>(0), row_valid - j * G));
  const int64_t start = r * a.row_len + j * G;
  float x[K], ep[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = k * kWarp + lane;
    x[k] = i < valid ? load_elem(a.g, a.dtype, start + i) : 0.f;
  }
  if (a.err.kind != kErrNone) {
    load_err<K>(a.err, gi, lane, ep);
#pragma unroll
    for (int k = 0; k < K; ++k) x[k] = __fadd_rn(x[k], ep[k]);
  }
  encode_group<BITS, K>(x, ep, gi, lane, a.b, a.omb, q_row(a.dst, r) + j * (G * BITS / 8), s_row(a.dst, r) + j,
                        a.err);
}

template <int BITS, int K>
__global__ void dequant_reduce_requant_kernel(Rows rows, int64_t ngroups, int64_t gpr, float b, float omb,
                                              Dest dst, ErrBuf err) {
  constexpr int G = K * kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (gi >= ngroups) return;
  float x[K], ep[K];
  reduce_group<BITS, K>(rows, gi, lane, x);
  if (err.kind != kErrNone) {
    load_err<K>(err, gi, lane, ep);
#pragma unroll
    for (int k = 0; k < K; ++k) x[k] = __fadd_rn(x[k], ep[k]);
  }
  const int64_t r = gi / gpr, j = gi - r * gpr;
  encode_group<BITS, K>(x, ep, gi, lane, b, omb, q_row(dst, r) + j * (G * BITS / 8), s_row(dst, r) + j, err);
}

template <int BITS, int K>
__global__ void dequant_reduce_kernel(Rows rows, float divisor, void* out, int out_dtype, int64_t n_out) {
  constexpr int G = K * kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (gi * G >= n_out) return;
  float acc[K];
  reduce_group<BITS, K>(rows, gi, lane, acc);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t i = gi * G + k * kWarp + lane;
    const float v = divisor != 1.f ? __fdiv_rn(acc[k], divisor) : acc[k];
    if (i < n_out) store_elem(out, out_dtype, i, v);
  }
}


// ---- vec16: the same kernels with wide accesses (the default; LOCO_CUDA_VARIANT=warp: the above) --
// Default since the H100 run of 2026-11-26 checked it (bitwise, and 1.6-2.3x the bandwidth of the
// kernels above: benchmarks/RESULTS.md, "GPU suite").  A
// group's G elements are spread over T = min(32, G / 16) lanes, 32 / T groups per warp; lane t
// holds, for p < P = G / (16 T), chunk c = p T + t of each half of the group: elements
// [8c, 8c + 8) (lo) and [G/2 + 8c, G/2 + 8c + 8) (hi).  Gradients, outputs and bf16/fp32 errors
// move 16 bytes per lane per chunk (fp32: 2 x 16), codes and int8 errors 8 bytes: a 4-bit byte
// packs elements j and j + G/2, so lane t's lo and hi chunks are its 8 code bytes [8c, 8c + 8).
// Per element the same float operations in the same order as above: bitwise the same results.
// The launchers fall back to the kernels above when an address or stride is not aligned.
constexpr int kV = 8;

template <int G>
struct VecShape {
  static constexpr int T = G / (2 * kV) < kWarp ? G / (2 * kV) : kWarp;  // lanes per group
  static constexpr int P = G / (2 * kV * T);                               // chunk pairs per lane
  static constexpr int K = 2 * kV * P;                                     // values per lane
  static constexpr int kGroupsPerBlock = kWarpsPerBlock * (kWarp / T);
};

// first element (in the group) of chunk q = 2 p + half of lane t
template <int G>
__device__ __forceinline__ int chunk_elem(int t, int q) {
  return (q % 2) * (G / 2) + ((q / 2) * VecShape<G>::T + t) * kV;
}

__device__ __forceinline__ float bits16_to_float(uint32_t b, int dtype) {
  return dtype == kBF16 ? __uint_as_float(b << 16) : __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}

// 8 elements from element i of p (16-byte aligned)
__device__ __forceinline__ void load8(const void* p, int dtype, int64_t i, float* out) {
  if (dtype == kF32) {
    const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i + 4);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
    return;
  }
  const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = bits16_to_float(w[j] & 0xffffu, dtype);
    out[2 * j + 1] = bits16_to_float(w[j] >> 16, dtype);
  }
}

__device__ __forceinline__ uint32_t float_to_bits16(float v, int dtype) {
  return dtype == kBF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
}

// 8 elements to element i of p (16-byte aligned)
__device__ __forceinline__ void store8(void* p, int dtype, int64_t i, const float* v) {
  if (dtype == kF32) {
    float* f = static_cast<float*>(p) + i;
    *reinterpret_cast<float4*>(f) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(f + 4) = make_float4(v[4], v[5], v[6], v[7]);
    return;
  }
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = float_to_bits16(v[2 * j], dtype) | (float_to_bits16(v[2 * j + 1], dtype) << 16);
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void load_bytes8(const uint8_t* p, uint8_t (&b)[8]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
#pragma unroll
  for (int j = 0; j < 4; ++j) b[j] = static_cast<uint8_t>(u.x >> (8 * j)), b[4 + j] = static_cast<uint8_t>(u.y >> (8 * j));
}

__device__ __forceinline__ void store_bytes8(uint8_t* p, const uint8_t (&b)[8]) {
  uint2 u;
  u.x = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
  u.y = b[4] | (b[5] << 8) | (b[6] << 16) | (static_cast<uint32_t>(b[7]) << 24);
  *reinterpret_cast<uint2*>(p) = u;
}

// the codes of this lane's values, from the group's codes qg (layout of store_codes above)
template <int BITS, int G>
__device__ __forceinline__ void vec_load_codes(const uint8_t* qg, int t, float (&c)[VecShape<G>::K]) {
  constexpr int P = VecShape<G>::P;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    float* lo = c + 2 * p * kV;
    float* hi = lo + kV;
    uint8_t b[8], d[8];
    if (BITS == 4) {
      load_bytes8(qg + chunk_elem<G>(t, 2 * p), b);
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        lo[v] = static_cast<float>(static_cast<int>(b[v] & 15) - 8);
        hi[v] = static_cast<float>(static_cast<int>(b[v] >> 4) - 8);
      }
    } else {
      load_bytes8(qg + chunk_elem<G>(t, 2 * p), b);
      load_bytes8(qg + chunk_elem<G>(t, 2 * p + 1), d);
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        lo[v] = static_cast<float>(static_cast<int8_t>(b[v]));
        hi[v] = static_cast<float>(static_cast<int8_t>(d[v]));
      }
    }
  }
}

template <int BITS, int G>
__device__ __forceinline__ void vec_store_codes(const float (&c)[VecShape<G>::K], uint8_t* qg, int t) {
  constexpr int P = VecShape<G>::P;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const float* lo = c + 2 * p * kV;
    const float* hi = lo + kV;
    uint8_t b[8], d[8];
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      if (BITS == 4) {
        b[v] = static_cast<uint8_t>((static_cast<int>(lo[v]) + 8) | ((static_cast<int>(hi[v]) + 8) << 4));
      } else {
        b[v] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(lo[v])));
        d[v] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(hi[v])));
      }
    }
    store_bytes8(qg + chunk_elem<G>(t, 2 * p), b);
    if (BITS == 8) store_bytes8(qg + chunk_elem<G>(t, 2 * p + 1), d);
  }
}

template <int G>
__device__ __forceinline__ void vec_load_err(const ErrBuf& e, int64_t gi, int t, float (&ep)[VecShape<G>::K]) {
  constexpr int K = VecShape<G>::K;
  if (e.kind == kErrInt8) {
    const float sc = e.scale[gi];
    vec_load_codes<8, G>(static_cast<const uint8_t*>(e.data) + gi * G, t, ep);
#pragma unroll
    for (int k = 0; k < K; ++k) ep[k] = __fmul_rn(ep[k], sc);
  } else {
#pragma unroll
    for (int q = 0; q < K / kV; ++q) load8(e.data, e.kind == kErrBF16 ? kBF16 : kF32, gi * G + chunk_elem<G>(t, q), ep + q * kV);
  }
}

// encode_group above, for a group spread over T lanes; every lane of the warp calls it (the
// shuffles), only active ones write
template <int BITS, int G>
__device__ __forceinline__ void vec_encode(const float (&x)[VecShape<G>::K], const float (&ep)[VecShape<G>::K],
                                           int64_t gi, int t, bool active, float b, float omb, uint8_t* qg,
                                           float* sg, const ErrBuf& e) {
  constexpr int T = VecShape<G>::T, K = VecShape<G>::K;
  constexpr float qmax = BITS == 4 ? 7.f : 127.f;
  float c[K];
  const float s = codes_of<K, T>(x, qmax, c);
  if (active) {
    if (t == 0) *sg = s;
    vec_store_codes<BITS, G>(c, qg, t);
  }
  if (e.kind == kErrNone) return;
  float en[K];
  new_error<K>(x, ep, c, s, b, omb, en);
  if (e.kind == kErrInt8) {
    float c8[K];
    const float s8 = codes_of<K, T>(en, 127.f, c8);
    if (!active) return;
    if (t == 0) e.scale[gi] = s8;
    vec_store_codes<8, G>(c8, static_cast<uint8_t*>(e.data) + gi * G, t);
  } else if (active) {
#pragma unroll
    for (int q = 0; q < K / kV; ++q) store8(e.data, e.kind == kErrBF16 ? kBF16 : kF32, gi * G + chunk_elem<G>(t, q), en + q * kV);
  }
}

template <int BITS, int G>
__device__ __forceinline__ void vec_reduce(const Rows& rows, int64_t gi, int t, float (&acc)[VecShape<G>::K]) {
  constexpr int K = VecShape<G>::K;
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = 0.f;
  for (int64_t s = 0; s < rows.S; ++s) {
    float c[K];
    vec_load_codes<BITS, G>(rows.q + s * rows.q_stride + gi * (G * BITS / 8), t, c);
    const float f = rows.scale[s * rows.s_stride + gi];
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] = __fadd_rn(acc[k], __fmul_rn(c[k], f));
  }
}

template <int BITS, int G>
__global__ void quantize_ef_vec_kernel(QefArgs a) {
  using S = VecShape<G>;
  const int t = threadIdx.x % S::T;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * S::kGroupsPerBlock + threadIdx.x / S::T;
  const bool active = gi < a.ngroups;
  const int64_t g = active ? gi : 0;  // idle lanes read group 0 and write nothing
  const int64_t gpr = a.cpad / G;
  const int64_t r = g / gpr, j = g - r * gpr;
  const int64_t row_valid = min(a.row_len, max(static_cast<int64_t>(0), a.n - r * a.row_len));
  const int64_t valid = min(static_cast<int64_t>(G), max(static_cast<int64_t>(0), row_valid - j * G));
  const int64_t start = r * a.row_len + j * G;
  float x[S::K], ep[S::K];
#pragma unroll
  for (int q = 0; q < S::K / kV; ++q) {
    const int e0 = chunk_elem<G>(t, q);
    if (e0 + kV <= valid) {
      load8(a.g, a.dtype, start + e0, x + q * kV);
    } else {
#pragma unroll
      for (int v = 0; v < kV; ++v) x[q * kV + v] = e0 + v < valid ? load_elem(a.g, a.dtype, start + e0 + v) : 0.f;
    }
  }
  if (a.err.kind != kErrNone) {
    vec_load_err<G>(a.err, g, t, ep);
#pragma unroll
    for (int k = 0; k < S::K; ++k) x[k] = __fadd_rn(x[k], ep[k]);
  }
  vec_encode<BITS, G>(x, ep, g, t, active, a.b, a.omb, q_row(a.dst, r) + j * (G * BITS / 8), s_row(a.dst, r) + j,
                      a.err);
}

template <int BITS, int G>
__global__ void dequant_reduce_requant_vec_kernel(Rows rows, int64_t ngroups, int64_t gpr, float b, float omb,
                                                  Dest dst, ErrBuf err) {
  using S = VecShape<G>;
  const int t = threadIdx.x % S::T;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * S::kGroupsPerBlock + threadIdx.x / S::T;
  const bool active = gi < ngroups;
  const int64_t g = active ? gi : 0;
  float x[S::K], ep[S::K];
  vec_reduce<BITS, G>(rows, g, t, x);
  if (err.kind != kErrNone) {
    vec_load_err<G>(err, g, t, ep);
#pragma unroll
    for (int k = 0; k < S::K; ++k) x[k] = __fadd_rn(x[k], ep[k]);
  }
  const int64_t r = g / gpr, j = g - r * gpr;
  vec_encode<BITS, G>(x, ep, g, t, active, b, omb, q_row(dst, r) + j * (G * BITS / 8), s_row(dst, r) + j, err);
}

template <int BITS, int G>
__global__ void dequant_reduce_vec_kernel(Rows rows, float divisor, void* out, int out_dtype, int64_t n_out) {
  using S = VecShape<G>;
  const int t = threadIdx.x % S::T;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * S::kGroupsPerBlock + threadIdx.x / S::T;
  if (gi * G >= n_out) return;  // no shuffles here: lanes may leave alone
  float acc[S::K];
  vec_reduce<BITS, G>(rows, gi, t, acc);
#pragma unroll
  for (int k = 0; k < S::K; ++k) acc[k] = divisor != 1.f ? __fdiv_rn(acc[k], divisor) : acc[k];
#pragma unroll
  for (int q = 0; q < S::K / kV; ++q) {
    const int64_t i0 = gi * G + chunk_elem<G>(t, q);
    if (i0 + kV <= n_out) {
      store8(out, out_dtype, i0, acc + q * kV);
    } else {
#pragma unroll
      for (int v = 0; v < kV; ++v)
        if (i0 + v < n_out) store_elem(out, out_dtype, i0 + v, acc[q * kV + v]);
    }
  }
}

// vec16 unless LOCO_CUDA_VARIANT is "warp" (loco_cuda.cpp refuses any other value first).
bool vec16_enabled() {
  const char* v = std::getenv("LOCO_CUDA_VARIANT");
  return v == nullptr || std::strcmp(v, "warp") != 0;
}

bool aligned(const void* p, int64_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

bool vec_dest_ok(const Dest& d) { return aligned(d.q, 8) && d.q_stride0 % 8 == 0 && d.q_stride1 % 8 == 0; }

bool vec_err_ok(const ErrBuf& e) { return e.kind == kErrNone || aligned(e.data, 16); }

bool vec_rows_ok(const Rows& r) { return aligned(r.q, 8) && r.q_stride % 8 == 0; }

template <int G>
dim3 vec_grid(int64_t ngroups) {
  constexpr int B = VecShape<G>::kGroupsPerBlock;
  return dim3(static_cast<unsigned>((ngroups + B - 1) / B));
}

inline dim3 grid_for(int64_t ngroups) {
  return dim3(static_cast<unsigned>((ngroups + kWarpsPerBlock - 1) / kWarpsPerBlock));
}

// calls F.template operator()<BITS, K>() for the runtime (bits, group_size)
template <typename F>
cudaError_t dispatch(int bits, int group_size, F f) {
#define LOCO_K(BITS, G) \
  if (bits == BITS && group_size == G) return f.template operator()<BITS, G / kWarp>();
  LOCO_K(4, 64) LOCO_K(4, 128) LOCO_K(4, 256) LOCO_K(4, 512) LOCO_K(4, 1024)
  LOCO_K(8, 64) LOCO_K(8, 128) LOCO_K(8, 256) LOCO_K(8, 512) LOCO_K(8, 1024)
#undef LOCO_K
  return cudaErrorInvalidValue;
}

struct LaunchQef {
  const QefArgs& a;
  cudaStream_t stream;
  bool vec;
  template <int BITS, int K>
  cudaError_t operator()() {
    if (vec)
      quantize_ef_vec_kernel<BITS, K * kWarp><<<vec_grid<K * kWarp>(a.ngroups), kWarpsPerBlock * kWarp, 0, stream>>>(a);
    else
      quantize_ef_kernel<BITS, K><<<grid_for(a.ngroups), kWarpsPerBlock * kWarp, 0, stream>>>(a);
    return cudaGetLastError();
  }
};

struct LaunchDrr {
  const Rows& rows;
  int64_t ngroups, gpr;
  float b, omb;
  const Dest& dst;
  const ErrBuf& err;
  cudaStream_t stream;
  bool vec;
  template <int BITS, int K>
  cudaError_t operator()() {
    if (vec)
      dequant_reduce_requant_vec_kernel<BITS, K * kWarp>
          <<<vec_grid<K * kWarp>(ngroups), kWarpsPerBlock * kWarp, 0, stream>>>(rows, ngroups, gpr, b, omb, dst, err);
    else
      dequant_reduce_requant_kernel<BITS, K>
          <<<grid_for(ngroups), kWarpsPerBlock * kWarp, 0, stream>>>(rows, ngroups, gpr, b, omb, dst, err);
    return cudaGetLastError();
  }
};

struct LaunchDr {
  const Rows& rows;
  float divisor;
  void* out;
  int out_dtype;
  int64_t n_out, ngroups;
  cudaStream_t stream;
  bool vec;
  template <int BITS, int K>
  cudaError_t operator()() {
    if (vec)
      dequant_reduce_vec_kernel<BITS, K * kWarp>
          <<<vec_grid<K * kWarp>(ngroups), kWarpsPerBlock * kWarp, 0, stream>>>(rows, divisor, out, out_dtype, n_out);
    else
      dequant_reduce_kernel<BITS, K>
          <<<grid_for(ngroups), kWarpsPerBlock * kWarp, 0, stream>>>(rows, divisor, out, out_dtype, n_out);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t launch_quantize_ef(int bits, int group_size, const QefArgs& a, cudaStream_t stream) {
  if (a.ngroups == 0) return cudaSuccess;
  const bool vec = vec16_enabled() && aligned(a.g, 16) && (a.row_len * (a.dtype == kF32 ? 4 : 2)) % 16 == 0 &&
                   vec_dest_ok(a.dst) && vec_err_ok(a.err);
  return dispatch(bits, group_size, LaunchQef{a, stream, vec});
}

cudaError_t launch_dequant_reduce_requant(int bits, int group_size, const Rows& rows, int64_t ngroups,
                                          int64_t gpr, float b, float omb, const Dest& dst, const ErrBuf& err,
                                          cudaStream_t stream) {
  if (ngroups == 0) return cudaSuccess;
  const bool vec = vec16_enabled() && vec_rows_ok(rows) && vec_dest_ok(dst) && vec_err_ok(err);
  return dispatch(bits, group_size, LaunchDrr{rows, ngroups, gpr, b, omb, dst, err, stream, vec});
}

cudaError_t launch_dequant_reduce(int bits, int group_size, const Rows& rows, float divisor, void* out,
                                  int out_dtype, int64_t n_out, cudaStream_t stream) {
  if (n_out == 0) return cudaSuccess;
  const int64_t ngroups = (n_out + group_size - 1) / group_size;
  const bool vec = vec16_enabled() && vec_rows_ok(rows) && aligned(out, 16);
  return dispatch(bits, group_size, LaunchDr{rows, divisor, out, out_dtype, n_out, ngroups, stream, vec});
}

}  // namespace cuda
}  // namespace loco
