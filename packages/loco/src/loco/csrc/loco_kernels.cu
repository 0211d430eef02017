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

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const uint32_t w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// codes (float, integral) of the K values of this lane; returns the group's scale
template <int K>
__device__ __forceinline__ float codes_of(const float (&x)[K], float qmax, float (&c)[K]) {
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint32_t a = __float_as_uint(x[k]) & kAbsMask;
    m = a > m ? a : m;
  }
  m = warp_max(m);
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
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const float r = __fsub_rn(x[k], __fmul_rn(c[k], s));
    en[k] = __fadd_rn(__fmul_rn(b, ep[k]), __fmul_rn(omb, r));
  }
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
  template <int BITS, int K>
  cudaError_t operator()() {
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
  template <int BITS, int K>
  cudaError_t operator()() {
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
  template <int BITS, int K>
  cudaError_t operator()() {
    dequant_reduce_kernel<BITS, K>
        <<<grid_for(ngroups), kWarpsPerBlock * kWarp, 0, stream>>>(rows, divisor, out, out_dtype, n_out);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t launch_quantize_ef(int bits, int group_size, const QefArgs& a, cudaStream_t stream) {
  if (a.ngroups == 0) return cudaSuccess;
  return dispatch(bits, group_size, LaunchQef{a, stream});
}

cudaError_t launch_dequant_reduce_requant(int bits, int group_size, const Rows& rows, int64_t ngroups,
                                          int64_t gpr, float b, float omb, const Dest& dst, const ErrBuf& err,
                                          cudaStream_t stream) {
  if (ngroups == 0) return cudaSuccess;
  return dispatch(bits, group_size, LaunchDrr{rows, ngroups, gpr, b, omb, dst, err, stream});
}

cudaError_t launch_dequant_reduce(int bits, int group_size, const Rows& rows, float divisor, void* out,
                                  int out_dtype, int64_t n_out, cudaStream_t stream) {
  if (n_out == 0) return cudaSuccess;
  const int64_t ngroups = (n_out + group_size - 1) / group_size;
  return dispatch(bits, group_size, LaunchDr{rows, divisor, out, out_dtype, n_out, ngroups, stream});
}

}  // namespace cuda
}  // namespace loco
