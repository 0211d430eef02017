// Receiver-side CPU kernels of LoCo: sums of quantized rows (dequantize-reduce, and
// dequantize-reduce-requantize with error feedback).  Split from loco_cpu.h, whose sender-side
// pieces (group loads, scales, encoding, the error buffer) they reuse; no torch headers.
//
// The 4-bit sums are kept in registers (reduce32_4bit): dequantize-reduce divides (multiplies
// by 1/divisor when that is exact: powers of two) and stores 16-bit outputs straight from them,
// dequantize-reduce-requantize adds the error to them before the shared encode phase.  Rows are
// added in order from +0 with separately rounded float32 multiplies and adds, as
// loco/reference.py does, so the results are bitwise the reference's.  Where the compiler targets
// AVX-512 (LOCO_AVX512), 4-bit groups take the AVX-512 versions below: codes dequantized by a
// 16-entry lookup, and for dequantize-reduce-requantize whole groups in registers.
#pragma once

#include "loco_cpu.h"

namespace loco {
namespace cpu {

// acc = sum over rows s of deQ(q[s]) for group gi, rows added in order
template <int BITS>
inline void reduce_group(const Rows& rows, int64_t gi, int64_t G, float* __restrict acc) {
  const uint8_t* q = rows.q;
  const int64_t q_stride = rows.q_stride;
  for (int64_t i = 0; i < G; ++i) acc[i] = 0.f;
  for (int64_t s = 0; s < rows.S; ++s) {
    const float f = rows.scale[s * rows.s_stride + gi];
    if constexpr (BITS == 4) {
      const int64_t H = G / 2;
      const uint8_t* __restrict p = q + s * q_stride + gi * H;
#if LOCO_AVX2
      const __m256 vf = _mm256_set1_ps(f);
      const __m256i fifteen = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
      for (int64_t j = 0; j < H; j += 8) {
        const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + j)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w, fifteen), eight));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(w, 4), eight));
        _mm256_storeu_ps(acc + j, _mm256_add_ps(_mm256_loadu_ps(acc + j), _mm256_mul_ps(lo, vf)));
        _mm256_storeu_ps(acc + j + H, _mm256_add_ps(_mm256_loadu_ps(acc + j + H), _mm256_mul_ps(hi, vf)));
      }
#else
      for (int64_t j = 0; j < H; ++j) acc[j] = acc[j] + static_cast<float>(static_cast<int>(p[j] & 15) - 8) * f;
      for (int64_t j = 0; j < H; ++j) acc[j + H] = acc[j + H] + static_cast<float>(static_cast<int>(p[j] >> 4) - 8) * f;
#endif
    } else {
      const int8_t* __restrict p = reinterpret_cast<const int8_t*>(q + s * q_stride) + gi * G;
      for (int64_t i = 0; i < G; ++i) acc[i] = acc[i] + static_cast<float>(p[i]) * f;
    }
  }
}

#if LOCO_AVX2
// Sums over the S rows of deQ for 32 elements of 4-bit group gi: the low nibbles of bytes
// j..j+16 (elements j..j+16) into lo[0], lo[1] and the high nibbles (elements j+H..j+H+16, H =
// G/2) into hi[0], hi[1].  Rows are added in order starting from +0, with the same float32
// multiply and add as reduce_group, kept in registers; one broadcast scale per row and 32 values.
inline void reduce32_4bit(const Rows& rows, int64_t gi, int64_t H, int64_t j, __m256 lo[2], __m256 hi[2]) {
  const __m256i fifteen = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  lo[0] = lo[1] = hi[0] = hi[1] = _mm256_setzero_ps();
  const uint8_t* p = rows.q + gi * H + j;
  const float* f = rows.scale + gi;
  for (int64_t s = 0; s < rows.S; ++s, p += rows.q_stride, f += rows.s_stride) {
    const __m256 vf = _mm256_broadcast_ss(f);
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
      const __m256 l = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w, fifteen), eight));
      const __m256 u = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(w, 4), eight));
      lo[h] = _mm256_add_ps(lo[h], _mm256_mul_ps(l, vf));
      hi[h] = _mm256_add_ps(hi[h], _mm256_mul_ps(u, vf));
    }
  }
}

// 8 float32 lanes -> bfloat16 (round to nearest even, NaN -> 0x7fc0, as to_bf16) in the low
// 16 bits of each int32 lane
inline __m256i bf16_lanes(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
}

// x = sum over rows of deQ (4-bit group gi) + deQ(e), ep = deQ(e); returns the max bits of |x|
// (reduce_group then fuse_x, with the sums kept in registers)
template <int EK>
inline uint32_t fuse_reduce4(const Rows& rows, const ErrBuf& e, int64_t gi, int64_t G, float* __restrict x,
                             float* __restrict ep) {
  const __m256i absm = _mm256_set1_epi32(static_cast<int>(kAbsMask));
  const __m256 vs = _mm256_set1_ps(EK == kErrInt8 ? e.scale[gi] : 0.f);
  const int64_t H = G / 2;
  __m256i vmax = _mm256_setzero_si256();
  for (int64_t j = 0; j < H; j += 16) {
    __m256 v[4];
    reduce32_4bit(rows, gi, H, j, v, v + 2);
    for (int h = 0; h < 4; ++h) {
      const int64_t i = j + (h & 1) * 8 + (h >> 1) * H;
      if constexpr (EK != kErrNone) {
        const __m256 pe = err8<EK>(e, gi * G + i, vs);
        _mm256_storeu_ps(ep + i, pe);
        v[h] = _mm256_add_ps(v[h], pe);
      }
      _mm256_storeu_ps(x + i, v[h]);
      vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_castps_si256(v[h]), absm));
    }
  }
  return hmax_u32(vmax);
}

inline uint32_t fuse_reduce4_any(const Rows& rows, const ErrBuf& e, int64_t gi, int64_t G, float* x, float* ep) {
  switch (e.kind) {
    case kErrInt8: return fuse_reduce4<kErrInt8>(rows, e, gi, G, x, ep);
    case kErrBF16: return fuse_reduce4<kErrBF16>(rows, e, gi, G, x, ep);
    case kErrF32: return fuse_reduce4<kErrF32>(rows, e, gi, G, x, ep);
    default: return fuse_reduce4<kErrNone>(rows, e, gi, G, x, ep);
  }
}

// store 16 float32 values (a then b) at element i of a float32 / bfloat16 / float16 array
template <int DT>
inline void store16(void* dst, int64_t i, __m256 a, __m256 b) {
  if constexpr (DT == kF32) {
    _mm256_storeu_ps(static_cast<float*>(dst) + i, a);
    _mm256_storeu_ps(static_cast<float*>(dst) + i + 8, b);
  } else {
    __m256i h;
    if constexpr (DT == kBF16) {  // one pack of both halves, then lanes back in order
      h = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_lanes(a), bf16_lanes(b)), 0xd8);
    } else {
      const int rc = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_cvtps_ph(a, rc)), _mm256_cvtps_ph(b, rc), 1);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i), h);
  }
}
#endif

#if LOCO_AVX512
// Dequantize-reduce-requantize of 4-bit groups of G = 64 or 128 with AVX-512 (the block path
// below takes the other cases): the sums of stage 1 below, then loco_cpu.h's in-register stages
// 2 and 3 (see run4_zmm there).  Instructions are saved where that changes no bit:
//  - deQ of a 4-bit code is a lookup: per row and group one multiply gives the 16 products
//    (k - 8) * scale, and vpermps picks each element's product by its nibble (vpermps reads only
//    the low 4 bits of each index, so the low nibble needs no mask and the high one a shift);
//  - the first row's products start the sum instead of being added to +0.  That can change only
//    the sign of a zero sum (+0 + -0 = +0), and a zero's sign changes no output of this
//    operator: +-0 have the same code byte and the same |x| bits, and x - code * scale is +0
//    for both.
// With the old block path's AVX2 loops this operator took 0.48 ns per element on L2-resident
// data, 0.36 with this one (benchmarks/loco_kernels_ab.cpp).

// deQ of the 16 4-bit codes with scale f: (k - 8) * f for k = 0..15, the reference's products
inline __m512 deq4_table(float f) {
  const __m512 k8 = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  return _mm512_mul_ps(k8, _mm512_set1_ps(f));
}

// Stage 1 of group gi: x = sum over rows of deQ (rows in order) + deQ(e), ep = deQ(e); returns
// the max bits of |x|
template <int NV, int EK>
__attribute__((always_inline)) inline uint32_t drr4_sum(const Rows& rows, const ErrBuf& e, int64_t gi,
                                                        __m512 (&x)[NV], __m512 (&ep)[NV]) {
  constexpr int G = 16 * NV, H = G / 2, NH = NV / 2;
  for (int v = 0; v < NV; ++v) x[v] = _mm512_setzero_ps();  // no rows: the sum is +0
  const uint8_t* p = rows.q + gi * H;
  const float* f = rows.scale + gi;
  for (int64_t s = 0; s < rows.S; ++s, p += rows.q_stride, f += rows.s_stride) {
    const __m512 t = deq4_table(*f);
    for (int v = 0; v < NH; ++v) {
      const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v)));
      const __m512 lo = _mm512_permutexvar_ps(w, t);                        // elements 16v.., low nibbles
      const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), t);  // elements H + 16v..
      x[v] = s == 0 ? lo : _mm512_add_ps(x[v], lo);
      x[v + NH] = s == 0 ? hi : _mm512_add_ps(x[v + NH], hi);
    }
  }
  return add_error_absmax16<NV, EK>(e, gi, x, ep);
}

// the whole operator on this path (G = 16 * NV), destinations as dequant_reduce_requant's
template <int NV, int EK, typename For>
void drr4_avx512(For&& parallel, const Rows& rows, int64_t M, float b, float omb, int64_t gpr, const Dest& dst,
                 const ErrBuf& e) {
  parallel(M / (16 * NV), [&](int64_t begin, int64_t end) {
    run4_zmm<NV, EK>(begin, end, gpr, dst, e, b, omb,
                     [&](int64_t gi, int64_t, int64_t, __m512(&x)[NV], __m512(&ep)[NV]) __attribute__((always_inline)) {
                       return drr4_sum<NV, EK>(rows, e, gi, x, ep);
                     });
  });
}

// Dequantize-reduce of one whole 4-bit group gi with AVX-512: 32 elements at a time (16 low
// nibbles, 16 high ones), deQ by lookup as in drr4_sum (the lookup tables of up to 8 rows made
// once per group), the rows added in order to +0 (here the sign of a zero sum is an output),
// divided (multiplied by recip = 1/divisor where that is exact) and stored as DT.  About 1.25x
// faster than the AVX2 loop in benchmarks/loco_kernels_ab.cpp.
template <int DT>
inline void dr4_group_avx512(const Rows& rows, int64_t gi, int64_t G, float divisor, float recip, void* out) {
  const int64_t H = G / 2;
  const __m512 vd = _mm512_set1_ps(divisor), vr = _mm512_set1_ps(recip);
  constexpr int64_t kTabs = 8;
  __m512 tab[kTabs];  // deQ of the 16 codes of row s, when S <= kTabs
  const bool tabled = rows.S <= kTabs;
  for (int64_t s = 0; tabled && s < rows.S; ++s)
    tab[s] = deq4_table(rows.scale[s * rows.s_stride + gi]);
  for (int64_t j = 0; j < H; j += 16) {
    __m512 v[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // elements j.. and H + j..
    const uint8_t* p = rows.q + gi * H + j;
    const float* f = rows.scale + gi;
    for (int64_t s = 0; s < rows.S; ++s, p += rows.q_stride, f += rows.s_stride) {
      const __m512 t = tabled ? tab[s] : deq4_table(*f);
      const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      v[0] = _mm512_add_ps(v[0], _mm512_permutexvar_ps(w, t));
      v[1] = _mm512_add_ps(v[1], _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), t));
    }
    for (int h = 0; h < 2; ++h) {
      if (divisor != 1.f) v[h] = recip != 0.f ? _mm512_mul_ps(v[h], vr) : _mm512_div_ps(v[h], vd);
      const int64_t i = gi * G + j + h * H;
      if constexpr (DT == kF32) {
        _mm512_storeu_ps(static_cast<float*>(out) + i, v[h]);
      } else {
        __m256i r;
        if constexpr (DT == kBF16) {  // as to_bf16: round to nearest even, NaN -> 0x7fc0
          const __m512i u = _mm512_castps_si512(v[h]);
          const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
          __m512i b = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
          b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(v[h], v[h], _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
          r = _mm512_cvtepi32_epi16(b);
        } else {
          r = _mm512_cvtps_ph(v[h], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), r);
      }
    }
  }
}

// runs the AVX-512 path if it takes this group size and error storage; false otherwise
template <typename For>
bool drr4_avx512_any(For&& parallel, const Rows& rows, int64_t M, int64_t G, float b, float omb, int64_t gpr,
                     const Dest& dst, const ErrBuf& e) {
  const bool i8 = e.kind == kErrInt8;
  if (!i8 && e.kind != kErrNone) return false;
  if (G == 64) {
    if (i8) drr4_avx512<4, kErrInt8>(parallel, rows, M, b, omb, gpr, dst, e);
    else drr4_avx512<4, kErrNone>(parallel, rows, M, b, omb, gpr, dst, e);
  } else if (G == 128) {
    if (i8) drr4_avx512<8, kErrInt8>(parallel, rows, M, b, omb, gpr, dst, e);
    else drr4_avx512<8, kErrNone>(parallel, rows, M, b, omb, gpr, dst, e);
  } else {
    return false;  // larger groups do not fit the registers
  }
  return true;
}
#endif

// ---- whole operators (see loco_cpu.h's quantize_ef for the parallel() contract) ----

// rows q[s] (S sources, M elements each) summed, plus the error, requantized into dst, whose
// rows hold gpr groups each
template <int BITS, typename For>
void dequant_reduce_requant(For&& parallel, const Rows& rows, int64_t M, int64_t G, float b, float omb, int64_t gpr,
                            const Dest& dst, const Err& e) {
#if LOCO_AVX512
  if constexpr (BITS == 4)
    if (drr4_avx512_any(parallel, rows, M, G, b, omb, gpr, dst, e)) return;
#endif
  const int64_t per_block = kBlock / G;
  parallel(M / G, [&](int64_t begin, int64_t end) {
    Scratch sc;
    GroupCursor at(begin, gpr);
    int64_t row = -1;  // destination row of the cached pointers (q_row / s_row divide)
    uint8_t* qr = nullptr;
    float* sr = nullptr;
    for (int64_t gi0 = begin; gi0 < end; gi0 += per_block) {
      const int64_t nb = std::min(per_block, end - gi0);
      for (int64_t k = 0; k < nb; ++k, at.next()) {
        const int64_t gi = gi0 + k;
        float* x = sc.x + k * G;
        float* ep = sc.ep + k * G;
#if LOCO_AVX2
        if constexpr (BITS == 4) {
          // the sum stays in registers: x = sum + deQ(e) in one pass
          sc.m[k] = fuse_reduce4_any(rows, e, gi, G, x, ep);
        } else {
          reduce_group<BITS>(rows, gi, G, x);
          const float* acc = x;
          sc.m[k] = fuse_x_any([acc](int64_t i) { return _mm256_loadu_ps(acc + i); }, e, gi, G, x, ep);
        }
#else
        reduce_group<BITS>(rows, gi, G, x);
        if (e.kind != kErrNone) {
          load_err(e, gi, G, ep);
          for (int64_t i = 0; i < G; ++i) x[i] = x[i] + ep[i];
        }
        sc.m[k] = absmax_bits(x, G);
#endif
        if (at.r != row) {
          row = at.r;
          qr = q_row(dst, row);
          sr = s_row(dst, row);
        }
        sc.q[k] = qr + at.j * G * BITS / 8;
        sc.sd[k] = sr + at.j;
      }
      encode_block<BITS>(sc, nb, gi0, G, b, omb, e);
    }
  });
}

// 1/d when d is a power of two whose reciprocal is a normal float, else 0: then v * (1/d) is
// exactly v / d for every float v (both are the correctly rounded v * 2^-k), and a multiply costs
// a fraction of a division
inline float exact_reciprocal(float d) {
  const uint32_t u = bits_of(d), ex = (u >> 23) & 0xffu;
  return (u & 0x7fffffu) == 0 && ex >= 1 && ex <= 253 ? 1.f / d : 0.f;
}

template <int DT, int BITS, typename For>
void dequant_reduce(For&& parallel, const Rows& rows, int64_t G, float divisor, void* out, int64_t n_out) {
  [[maybe_unused]] const float recip = exact_reciprocal(divisor);
  parallel((n_out + G - 1) / G, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxGroup];
    for (int64_t gi = begin; gi < end; ++gi) {
#if LOCO_AVX512
      if (BITS == 4 && (gi + 1) * G <= n_out) {  // whole group: sum, divide, convert, store
        dr4_group_avx512<DT>(rows, gi, G, divisor, recip, out);
        continue;
      }
#elif LOCO_AVX2
      if (BITS == 4 && (gi + 1) * G <= n_out) {  // whole group: sum, divide, convert, store
        const int64_t H = G / 2;
        const __m256 vd = _mm256_set1_ps(divisor), vr = _mm256_set1_ps(recip);
        for (int64_t j = 0; j < H; j += 16) {
          __m256 v[4];  // elements j, j+8, j+H, j+H+8
          reduce32_4bit(rows, gi, H, j, v, v + 2);
          for (int h = 0; h < 4 && divisor != 1.f; ++h)
            v[h] = recip != 0.f ? _mm256_mul_ps(v[h], vr) : _mm256_div_ps(v[h], vd);
          store16<DT>(out, gi * G + j, v[0], v[1]);
          store16<DT>(out, gi * G + j + H, v[2], v[3]);
        }
        continue;
      }
#endif
      reduce_group<BITS>(rows, gi, G, acc);
      if (divisor != 1.f)
        for (int64_t i = 0; i < G; ++i) acc[i] = acc[i] / divisor;
      store_run<DT>(out, gi * G, std::min(G, n_out - gi * G), acc);
    }
  });
}

}  // namespace cpu
}  // namespace loco
