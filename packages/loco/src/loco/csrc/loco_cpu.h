// CPU kernels of LoCo, one quantization group at a time; no torch headers (loco_ops.cpp wraps
// them as operators, and a standalone benchmark can include this file alone).
//
// Groups are processed a block at a time (up to 1024 elements, e.g. 8 groups of 128), in
// phases over small float arrays that stay in L1:
//   1. x = g + deQ(e), and max |x| per group (as the bits of |x|: exact, NaN/inf visible);
//   2. scales of the block's groups (one vector division for 8 groups: the divisions sit
//      between phase 1 and 3 and would stall each group), codes, packed codes, residual
//      x - code*scale, new error e, max |e| per group;
//   3. scales and int8 codes of the new errors (or their bf16/fp32 store).
// The loops are plain C++ the compiler vectorizes, with AVX2 intrinsic versions of the hot ones
// (the portable loops spend most of their time narrowing int32 lanes to bytes).  Both do the same
// float32 operations: -ffp-contract=off keeps every multiply and add separately rounded, as in
// loco/reference.py, so the results are bitwise the reference's.  The AVX2 path saves
// instructions where that changes no bit: 4-bit bytes are built from the rounded codes in exact
// float arithmetic (an add and a multiply-add on integers below 2^24, then one integer subtract),
// not by converting both codes to int32 and shifting; int8 error codes come from one vcvtps2dq
// (round to nearest even in the default MXCSR mode) instead of a vroundps and a conversion.
// Where the compiler targets AVX-512 (LOCO_AVX512), 4-bit quantize_ef with G = 64 or 128 and an
// int8 or no error buffer skips the blocks: each group stays in zmm registers through all three
// phases (run4_zmm below, shared with dequant_reduce_requant in loco_cpu_recv.h).
#pragma once

#include <stdint.h>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define LOCO_AVX2 1
#else
#define LOCO_AVX2 0
#endif
// AVX-512 versions of some hot loops (built when the compiler targets AVX-512F: loco/ops.py adds
// -mavx512f... where torch reports an AVX-512 CPU, and the AVX2 or portable code otherwise)
#if LOCO_AVX2 && defined(__AVX512F__)
#define LOCO_AVX512 1
#else
#define LOCO_AVX512 0
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "loco_common.h"

namespace loco {
namespace cpu {

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
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & kAbsMask) > kInfBits ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
}

inline float from_bf16(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

#if defined(__FLT16_MAX__)
inline float from_f16(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, sizeof v);
  return static_cast<float>(v);
}
inline uint16_t to_f16(float f) {
  const _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, sizeof h);
  return h;
}
#else
#error "loco's CPU kernels need a compiler with _Float16 (GCC >= 12, Clang >= 15)"
#endif

template <int DT>
inline float load1(const void* p, int64_t i) {
  if constexpr (DT == kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (DT == kBF16) {
    return from_bf16(static_cast<const uint16_t*>(p)[i]);
  } else {
    return from_f16(static_cast<const uint16_t*>(p)[i]);
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

using Err = ErrBuf;

inline uint8_t* q_row(const Dest& d, int64_t r) { return d.q + (r / d.B) * d.q_stride0 + (r % d.B) * d.q_stride1; }
inline float* s_row(const Dest& d, int64_t r) { return d.scale + (r / d.B) * d.s_stride0 + (r % d.B) * d.s_stride1; }

constexpr int64_t kBlock = 1024;        // elements per block
constexpr int64_t kMaxBlockGroups = 16;  // kBlock / smallest group size (64)

// Work arrays of one thread: one block of groups.
struct Scratch {
  alignas(64) float x[kBlock];
  alignas(64) float ep[kBlock];
  alignas(64) float en[kBlock];
  uint32_t m[kMaxBlockGroups], me[kMaxBlockGroups];
  alignas(32) float s[kMaxBlockGroups], inv[kMaxBlockGroups];
  uint8_t* q[kMaxBlockGroups];  // where each group's codes and scale go
  float* sd[kMaxBlockGroups];
};

// ep = deQ(e) of group gi
inline void load_err(const Err& e, int64_t gi, int64_t G, float* __restrict ep) {
  const int64_t off = gi * G;
  if (e.kind == kErrInt8) {
    const int8_t* __restrict s = static_cast<const int8_t*>(e.data) + off;
    const float sc = e.scale[gi];
    for (int64_t i = 0; i < G; ++i) ep[i] = static_cast<float>(s[i]) * sc;
  } else if (e.kind == kErrBF16) {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(e.data) + off;
    for (int64_t i = 0; i < G; ++i) ep[i] = from_bf16(s[i]);
  } else {
    const float* __restrict s = static_cast<const float*>(e.data) + off;
    for (int64_t i = 0; i < G; ++i) ep[i] = s[i];
  }
}

// scale and 1/scale of a group from the max of the bits of |x|; false if the group is not finite
inline bool scale_of(uint32_t m, float qmax, float& scale, float& inv) {
  if (m >= kInfBits) {
    scale = std::numeric_limits<float>::infinity();
    inv = 0.f;
    return false;
  }
  scale = 0.f;
  inv = 0.f;
  if (m >= kTinyBits) {
    const float amax = from_bits(m);
    scale = amax / qmax;
    inv = qmax / amax;
  }
  return true;
}

inline float code_of(float v, float inv) {
  // |v * inv| <= qmax * (1 + 2^-22) for every v of a finite group, so the reference's clamp to
  // [-qmax, qmax] never changes a code and is left out here
  return std::nearbyint(v * inv);
}

inline uint32_t absmax_bits(const float* __restrict v, int64_t G) {
  uint32_t m = 0;
  for (int64_t i = 0; i < G; ++i) {
    const uint32_t a = bits_of(v[i]) & kAbsMask;
    m = a > m ? a : m;
  }
  return m;
}

#if LOCO_AVX2
inline __m256 round_even(__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// 32 int32 lanes (values fit a byte) -> 32 bytes in order
inline __m256i narrow_u8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
  return _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline __m256i narrow_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline uint32_t hmax_u32(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// 8 float32 values from element i of a float32 / bfloat16 / float16 array (exact)
template <int DT>
inline __m256 load8(const void* p, int64_t i) {
  if constexpr (DT == kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (DT == kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
}

// deQ of 8 error values at element `off` (EK: ErrKind, int8 with the group's scale vs)
template <int EK>
inline __m256 err8(const ErrBuf& e, int64_t off, __m256 vs) {
  if constexpr (EK == kErrInt8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(e.data) + off));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vs);
  } else {
    return load8<EK == kErrBF16 ? kBF16 : kF32>(e.data, off);
  }
}

// x[i] = v[i] (+ deQ(e)[i], kept in ep); returns the max bits of |x|.  v: `load(i)` -> __m256.
template <int EK, typename Load>
inline uint32_t fuse_x(Load&& load, const ErrBuf& e, int64_t gi, int64_t G, float* __restrict x, float* __restrict ep) {
  const __m256i absm = _mm256_set1_epi32(static_cast<int>(kAbsMask));
  const __m256 vs = _mm256_set1_ps(EK == kErrInt8 ? e.scale[gi] : 0.f);
  __m256i vmax = _mm256_setzero_si256();
  for (int64_t i = 0; i < G; i += 8) {
    __m256 v = load(i);
    if constexpr (EK != kErrNone) {
      const __m256 p = err8<EK>(e, gi * G + i, vs);
      _mm256_storeu_ps(ep + i, p);
      v = _mm256_add_ps(v, p);
    }
    _mm256_storeu_ps(x + i, v);
    vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_castps_si256(v), absm));
  }
  return hmax_u32(vmax);
}

template <typename Load>
inline uint32_t fuse_x_any(Load&& load, const ErrBuf& e, int64_t gi, int64_t G, float* x, float* ep) {
  switch (e.kind) {
    case kErrInt8: return fuse_x<kErrInt8>(load, e, gi, G, x, ep);
    case kErrBF16: return fuse_x<kErrBF16>(load, e, gi, G, x, ep);
    case kErrF32: return fuse_x<kErrF32>(load, e, gi, G, x, ep);
    default: return fuse_x<kErrNone>(load, e, gi, G, x, ep);
  }
}
#endif

// scale[k], inv[k] of groups k < nb from their max bits m[k], as scale_of does one at a time
inline void scales_of(const uint32_t* m, int64_t nb, float qmax, float* scale, float* inv) {
#if LOCO_AVX2
  for (int64_t k0 = 0; k0 < nb; k0 += 8) {
    alignas(32) uint32_t mm[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t k = k0; k < std::min(nb, k0 + 8); ++k) mm[k - k0] = m[k];
    const __m256i mi = _mm256_load_si256(reinterpret_cast<const __m256i*>(mm));  // |x| bits < 2^31
    const __m256 nonfinite = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mi, _mm256_set1_epi32(kInfBits - 1)));
    const __m256 big = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mi, _mm256_set1_epi32(kTinyBits - 1)));
    const __m256 usable = _mm256_andnot_ps(nonfinite, big);
    const __m256 one = _mm256_set1_ps(1.f), q = _mm256_set1_ps(qmax), zero = _mm256_setzero_ps();
    const __m256 safe = _mm256_blendv_ps(one, _mm256_castsi256_ps(mi), usable);
    __m256 sc = _mm256_blendv_ps(zero, _mm256_div_ps(safe, q), usable);
    sc = _mm256_blendv_ps(sc, _mm256_set1_ps(std::numeric_limits<float>::infinity()), nonfinite);
    const __m256 iv = _mm256_blendv_ps(zero, _mm256_div_ps(q, safe), usable);
    alignas(32) float ss[8], ii[8];
    _mm256_store_ps(ss, sc);
    _mm256_store_ps(ii, iv);
    for (int64_t k = k0; k < std::min(nb, k0 + 8); ++k) {
      scale[k] = ss[k - k0];
      inv[k] = ii[k - k0];
    }
  }
#else
  for (int64_t k = 0; k < nb; ++k) scale_of(m[k], qmax, scale[k], inv[k]);
#endif
}

// int8 codes of v[0..G) with the 8-bit scale's inverse inv into d (m: max bits, for non-finite)
inline void encode8(const float* __restrict v, uint32_t m, float inv, int64_t G, int8_t* __restrict d) {
  if (m >= kInfBits) {
    for (int64_t i = 0; i < G; ++i) d[i] = 0;
    return;
  }
#if LOCO_AVX2
  // vcvtps2dq rounds in the MXCSR mode, round-to-nearest-even unless a caller changed it (torch
  // never does): the same integer as round_even then a conversion, one instruction fewer
  const __m256 vi = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < G; i += 32) {
    __m256i c[4];
    for (int u = 0; u < 4; ++u) c[u] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * u), vi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), narrow_i8(c[0], c[1], c[2], c[3]));
  }
#else
  for (int64_t i = 0; i < G; ++i) d[i] = static_cast<int8_t>(static_cast<int>(code_of(v[i], inv)));
#endif
}

// Pass 2 for a finite group: codes of x into q (packed), and with error feedback
// en = b * ep + omb * (x - code * s); returns the max bits of |en|.
template <int BITS>
inline uint32_t encode_codes(const float* __restrict x, const float* __restrict ep, int64_t G, float s, float inv,
                             float b, float omb, bool ef, uint8_t* __restrict q, float* __restrict en) {
  uint32_t me = 0;
#if LOCO_AVX2
  const __m256 vi = _mm256_set1_ps(inv), vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b),
               vo = _mm256_set1_ps(omb);
  const __m256i absm = _mm256_set1_epi32(static_cast<int>(kAbsMask));
  // 4-bit bytes in float arithmetic, exact (integers below 2^24): (c0 + (M + 136)) + 16 * c1 with
  // M = 1.5 * 2^23 is M + (c0 + 8) + 16 * (c1 + 8), whose bits minus M's are the packed byte
  const __m256 magic = _mm256_set1_ps(12582912.f + 136.f), sixteen = _mm256_set1_ps(16.f);
  const __m256i mbits = _mm256_set1_epi32(0x4b400000);
  __m256i vmax = _mm256_setzero_si256();
  // 4-bit: 32 bytes per step, from elements [j, j+32) and [j+H, j+H+32); 8-bit: 32 elements
  const int64_t H = BITS == 4 ? G / 2 : G;
  for (int64_t j = 0; j < H; j += 32) {
    __m256i w[4];
    for (int u = 0; u < 4; ++u) {
      const int64_t i0 = j + 8 * u;
      const __m256 x0 = _mm256_loadu_ps(x + i0);
      const __m256 c0 = round_even(_mm256_mul_ps(x0, vi));
      if (ef) {
        const __m256 r = _mm256_sub_ps(x0, _mm256_mul_ps(c0, vs));
        const __m256 e = _mm256_add_ps(_mm256_mul_ps(vb, _mm256_loadu_ps(ep + i0)), _mm256_mul_ps(vo, r));
        _mm256_storeu_ps(en + i0, e);
        vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_castps_si256(e), absm));
      }
      if constexpr (BITS == 4) {
        const int64_t i1 = i0 + H;
        const __m256 x1 = _mm256_loadu_ps(x + i1);
        const __m256 c1 = round_even(_mm256_mul_ps(x1, vi));
        if (ef) {
          const __m256 r = _mm256_sub_ps(x1, _mm256_mul_ps(c1, vs));
          const __m256 e = _mm256_add_ps(_mm256_mul_ps(vb, _mm256_loadu_ps(ep + i1)), _mm256_mul_ps(vo, r));
          _mm256_storeu_ps(en + i1, e);
          vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_castps_si256(e), absm));
        }
#if defined(__FMA__)
        const __m256 y = _mm256_fmadd_ps(c1, sixteen, _mm256_add_ps(c0, magic));  // exact: no rounding
#else
        const __m256 y = _mm256_add_ps(_mm256_mul_ps(c1, sixteen), _mm256_add_ps(c0, magic));
#endif
        w[u] = _mm256_sub_epi32(_mm256_castps_si256(y), mbits);
      } else {
        w[u] = _mm256_cvtps_epi32(c0);
      }
    }
    const __m256i bytes = BITS == 4 ? narrow_u8(w[0], w[1], w[2], w[3]) : narrow_i8(w[0], w[1], w[2], w[3]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), bytes);
  }
  me = hmax_u32(vmax);
#else
  const int64_t H = BITS == 4 ? G / 2 : G;
  for (int64_t j = 0; j < H; ++j) {
    const float c0 = code_of(x[j], inv);
    if constexpr (BITS == 4) {
      const float c1 = code_of(x[j + H], inv);
      q[j] = static_cast<uint8_t>((static_cast<int>(c0) + 8) | ((static_cast<int>(c1) + 8) << 4));
    } else {
      q[j] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(c0)));
    }
  }
  if (ef) {
    for (int64_t i = 0; i < G; ++i) {
      const float c = code_of(x[i], inv);
      const float v = b * ep[i] + omb * (x[i] - c * s);
      en[i] = v;
      const uint32_t a = bits_of(v) & kAbsMask;
      me = a > me ? a : me;
    }
  }
#endif
  return me;
}

// Phases 2 and 3 for the nb groups of a block (first group gi0) held in sc: sc.x the values,
// sc.ep the previous errors, sc.m the max bits, sc.q / sc.sd the destinations.  The error
// groups gi0.. are overwritten in place (they were read into sc.ep in phase 1).
template <int BITS>
inline void encode_block(Scratch& sc, int64_t nb, int64_t gi0, int64_t G, float b, float omb, const Err& e) {
  constexpr float qmax = BITS == 4 ? 7.f : 127.f;
  const bool ef = e.kind != kErrNone;
  scales_of(sc.m, nb, qmax, sc.s, sc.inv);
  for (int64_t k = 0; k < nb; ++k) {
    const float* x = sc.x + k * G;
    const float* ep = sc.ep + k * G;
    float* en = sc.en + k * G;
    *sc.sd[k] = sc.s[k];
    if (sc.m[k] < kInfBits) {
      sc.me[k] = encode_codes<BITS>(x, ep, G, sc.s[k], sc.inv[k], b, omb, ef, sc.q[k], en);
    } else {
      // codes 0 and scale inf: deQ is NaN, so the error and the receivers see a non-finite value
      std::memset(sc.q[k], BITS == 4 ? 0x88 : 0, static_cast<size_t>(G * BITS / 8));
      if (ef)
        for (int64_t i = 0; i < G; ++i) en[i] = b * ep[i] + omb * (x[i] - 0.f * sc.s[k]);
      sc.me[k] = kInfBits;
    }
  }
  if (!ef) return;
  if (e.kind == kErrInt8) {
    scales_of(sc.me, nb, 127.f, sc.s, sc.inv);
    for (int64_t k = 0; k < nb; ++k) {
      e.scale[gi0 + k] = sc.s[k];
      encode8(sc.en + k * G, sc.me[k], sc.inv[k], G, static_cast<int8_t*>(e.data) + (gi0 + k) * G);
    }
  } else if (e.kind == kErrBF16) {
    store_run<kBF16>(e.data, gi0 * G, nb * G, sc.en);
  } else {
    store_run<kF32>(e.data, gi0 * G, nb * G, sc.en);
  }
}

// x = pad(g) + deQ(e) for group gi, whose first element is g[start] and of which `valid`
// elements are in g (the rest is padding); returns the max bits of |x|
template <int DT>
inline uint32_t load_group(float* __restrict x, float* __restrict ep, const void* g, int64_t start, int64_t valid,
                           int64_t gi, int64_t G, const Err& e) {
#if LOCO_AVX2
  if (valid == G) return fuse_x_any([g, start](int64_t i) { return load8<DT>(g, start + i); }, e, gi, G, x, ep);
  if (e.kind != kErrNone) load_err(e, gi, G, ep);
#else
  if (e.kind != kErrNone) load_err(e, gi, G, ep);
  if (valid == G) {
    uint32_t m = 0;
    for (int64_t i = 0; i < G; ++i) {
      const float v = e.kind != kErrNone ? load1<DT>(g, start + i) + ep[i] : load1<DT>(g, start + i);
      x[i] = v;
      const uint32_t a = bits_of(v) & kAbsMask;
      m = a > m ? a : m;
    }
    return m;
  }
#endif
  for (int64_t i = 0; i < G; ++i) x[i] = i < valid ? load1<DT>(g, start + i) : 0.f;
  if (e.kind != kErrNone)
    for (int64_t i = 0; i < G; ++i) x[i] = x[i] + ep[i];
  return absmax_bits(x, G);
}

// Walks groups begin, begin+1, ... of rows of gpr groups, dividing only once (64-bit divisions
// cost tens of cycles, as much as a third of a group's work).
struct GroupCursor {
  int64_t r, j, gpr;
  GroupCursor(int64_t begin, int64_t groups_per_row) : r(begin / groups_per_row), j(begin % groups_per_row), gpr(groups_per_row) {}
  void next() {
    if (++j == gpr) {
      j = 0;
      ++r;
    }
  }
};

#if LOCO_AVX512
// 4-bit quantization with error feedback of groups of G = 64 or 128 with AVX-512, the group held
// in zmm registers (NV = G/16 of them for x, NV for deQ(e)) from the loads to the stores: no
// scratch arrays, so no stores and reloads between the phases.  quantize_ef (below) and
// dequant_reduce_requant (loco_cpu_recv.h) differ only in how x is made (stage 1); stages 2 and
// 3 are shared.  Every rounded float32 operation is the block path's, in the same order, so the
// results are bitwise the reference's.  The 4-bit bytes come from the float codes in exact float
// arithmetic (as encode_codes does) and vpmovdb keeps the low byte of each lane, which is the
// packed byte; int8 error codes are a vcvtps2dq (round to nearest even in the default MXCSR
// mode) and a vpmovdb.  EK: kErrInt8 or kErrNone (other error storages take the block path).

// max bits of |v| over NV vectors (and + unsigned max, in a tree)
template <int NV>
__attribute__((always_inline)) inline uint32_t absmax_bits16(const __m512 (&v)[NV]) {
  const __m512i absm = _mm512_set1_epi32(static_cast<int>(kAbsMask));
  __m512i a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm512_and_si512(_mm512_castps_si512(v[i]), absm);
  for (int w = NV / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = _mm512_max_epu32(a[i], a[i + w]);
  return _mm512_reduce_max_epu32(a[0]);
}

// Stage 2 of a finite group (scale sc, 1 / scale inv): packed codes of x into q; with error
// feedback the new error en = bep + omb * (x - code * sc), where bep = b * deQ(e) was rounded in
// stage 1; returns the max bits of |en|.  x, bep and en are the group's slot arrays.
template <int NV, int EK>
__attribute__((always_inline)) inline uint32_t encode4_zmm(const float* __restrict xs, const float* __restrict beps,
                                                           float sc, float inv, uint8_t* q, float omb,
                                                           float* __restrict ens) {
  constexpr int NH = NV / 2;
  const __m512 vi = _mm512_set1_ps(inv);
  __m512 c[NV];
  for (int v = 0; v < NV; ++v)
    c[v] = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_load_ps(xs + 16 * v), vi),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // (c0 + (M + 136)) + 16 * c1, M = 1.5 * 2^23: exact, its low byte is (c0 + 8) | (c1 + 8) << 4
  const __m512 magic = _mm512_set1_ps(12582912.f + 136.f), sixteen = _mm512_set1_ps(16.f);
  for (int v = 0; v < NH; ++v) {
    const __m512 y = _mm512_fmadd_ps(c[v + NH], sixteen, _mm512_add_ps(c[v], magic));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * v), _mm512_cvtepi32_epi8(_mm512_castps_si512(y)));
  }
  if constexpr (EK == kErrNone) return 0;
  const __m512 vsc = _mm512_set1_ps(sc), vo = _mm512_set1_ps(omb);
  __m512 en[NV];
  for (int v = 0; v < NV; ++v) {
    const __m512 r = _mm512_sub_ps(_mm512_load_ps(xs + 16 * v), _mm512_mul_ps(c[v], vsc));
    en[v] = _mm512_add_ps(_mm512_load_ps(beps + 16 * v), _mm512_mul_ps(vo, r));
    _mm512_store_ps(ens + 16 * v, en[v]);
  }
  return absmax_bits16<NV>(en);
}

// Stage 3: int8 codes of the new error en (slot array) over the old codes at ec (einv: 127 /
// max |en|, or 0 for a tiny max; not finite: codes 0, as the scale is inf)
template <int NV>
__attribute__((always_inline)) inline void requant_err_zmm(const float* __restrict ens, bool finite, float einv,
                                                            int8_t* ec) {
  if (!finite) {
    std::memset(ec, 0, 16 * NV);
    return;
  }
  const __m512 vei = _mm512_set1_ps(einv);
  for (int v = 0; v < NV; ++v)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ec + 16 * v),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(ens + 16 * v), vei))));
}

// Groups begin..end-1 (rows of gpr groups, codes and scales into dst): stage 1 is
// load(gi, row, column, x, ep) -> max bits of |x|, then stages 2 and 3 above.  A group's steps
// are one long chain of dependent instructions (max -> division -> codes -> error max ->
// division -> error codes), which the core cannot overlap with the next group's: the waiting
// instructions of one group fill its schedulers.  So the loop is software-pipelined: iteration
// g runs stage 1 of group g, stage 3 of g - 2 and stage 2 of g - 1, and the values a stage
// hands to the next (x, b * deQ(e), the new error, the scales) wait in two slots on the stack,
// where every division has had a whole iteration to finish.  The rounded operations are the
// same as in one pass (b * deQ(e) is the same product, only made earlier), so the results are
// too.  On Zen 4 this made dequant_reduce_requant 1.10-1.13x and quantize_ef 1.03x faster than
// the previous loop, which only ran a group's stage 3 after the next group's stage 1
// (benchmarks/loco_kernels_ab.cpp).
template <int NV, int EK, typename Load>
__attribute__((always_inline)) inline void run4_zmm(int64_t begin, int64_t end, int64_t gpr, const Dest& dst,
                                                    const ErrBuf& e, float b, float omb, Load&& load) {
  static_assert(NV % 2 == 0 && (EK == kErrInt8 || EK == kErrNone), "run4_zmm");
  constexpr int64_t G = 16 * NV;
  constexpr bool kEF = EK == kErrInt8;
  struct alignas(64) Slot {
    float x[G], bep[G], en[G];
    uint8_t* q;
    float sc, inv, einv;
    bool fin, efin;
  };
  Slot sl[2];
  GroupCursor at(begin, gpr);
  int64_t row = -1;  // destination row of the cached pointers (q_row / s_row divide)
  uint8_t* qr = nullptr;
  float* sr = nullptr;
  const __m512 vb = _mm512_set1_ps(b);
  for (int64_t gi = begin; gi < end + 2; ++gi) {
    if (gi < end) {  // stage 1 of gi, and its scale
      if (at.r != row) {
        row = at.r;
        qr = q_row(dst, row);
        sr = s_row(dst, row);
      }
      Slot& s = sl[gi & 1];
      __m512 x[NV], ep[NV];
      const uint32_t m = load(gi, at.r, at.j, x, ep);
      for (int v = 0; v < NV; ++v) {
        _mm512_store_ps(s.x + 16 * v, x[v]);
        if constexpr (kEF) _mm512_store_ps(s.bep + 16 * v, _mm512_mul_ps(vb, ep[v]));
      }
      s.fin = scale_of(m, 7.f, s.sc, s.inv);
      sr[at.j] = s.sc;
      s.q = qr + at.j * (G / 2);
      at.next();
    }
    if constexpr (kEF)
      if (gi - 2 >= begin) {
        const Slot& s = sl[(gi - 2) & 1];
        requant_err_zmm<NV>(s.en, s.efin, s.einv, static_cast<int8_t*>(e.data) + (gi - 2) * G);
      }
    if (gi - 1 >= begin && gi - 1 < end) {
      Slot& s = sl[(gi - 1) & 1];
      uint32_t me = kInfBits;  // not finite: codes 0 and scale inf, then error codes 0 (scale inf)
      if (s.fin) me = encode4_zmm<NV, EK>(s.x, s.bep, s.sc, s.inv, s.q, omb, s.en);
      else std::memset(s.q, 0x88, G / 2);
      if constexpr (kEF) s.efin = scale_of(me, 127.f, e.scale[gi - 1], s.einv);
    }
  }
}

// The end of stage 1 on both paths: with an int8 error, ep = deQ(e) of group gi and x += ep;
// returns the max bits of |x|
template <int NV, int EK>
__attribute__((always_inline)) inline uint32_t add_error_absmax16(const ErrBuf& e, int64_t gi, __m512 (&x)[NV],
                                                                  __m512 (&ep)[NV]) {
  if constexpr (EK == kErrInt8) {
    const int8_t* ec = static_cast<const int8_t*>(e.data) + gi * 16 * NV;
    const __m512 vs = _mm512_set1_ps(e.scale[gi]);
    for (int v = 0; v < NV; ++v) {
      const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ec + 16 * v)));
      ep[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(c), vs);
      x[v] = _mm512_add_ps(x[v], ep[v]);
    }
  }
  return absmax_bits16<NV>(x);
}

// 16 float32 values from element i of a float32 / bfloat16 / float16 array (exact)
template <int DT>
inline __m512 load16(const void* p, int64_t i) {
  if constexpr (DT == kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (DT == kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else return _mm512_cvtph_ps(h);
  }
}

// quantize_ef on this path (G = 16 * NV, arguments as quantize_ef's).  Stage 1: x = pad(g) +
// deQ(e); a group cut by the end of its row or of g is padded in load_group's scratch arrays.
template <int DT, int NV, int EK, typename For>
void qef4_avx512(For&& parallel, const void* g, int64_t n, int64_t row_len, int64_t cpad, int64_t nrows, float b,
                 float omb, const Dest& dst, const ErrBuf& e) {
  constexpr int64_t G = 16 * NV;
  const int64_t gpr = cpad / G;
  parallel(gpr * nrows, [&](int64_t begin, int64_t end) {
    int64_t row = -1, row_valid = 0;
    alignas(64) float px[G], pep[G];
    auto load = [&](int64_t gi, int64_t r, int64_t j, __m512(&x)[NV], __m512(&ep)[NV]) __attribute__((always_inline)) {
      if (r != row) {
        row = r;
        row_valid = std::min(row_len, std::max<int64_t>(0, n - r * row_len));
      }
      const int64_t start = r * row_len + j * G, valid = std::min(G, std::max<int64_t>(0, row_valid - j * G));
      if (valid < G) {  // padded group
        const uint32_t m = load_group<DT>(px, pep, g, start, valid, gi, G, e);
        for (int v = 0; v < NV; ++v) {
          x[v] = _mm512_load_ps(px + 16 * v);
          ep[v] = EK == kErrInt8 ? _mm512_load_ps(pep + 16 * v) : _mm512_setzero_ps();
        }
        return m;
      }
      for (int v = 0; v < NV; ++v) x[v] = load16<DT>(g, start + 16 * v);
      return add_error_absmax16<NV, EK>(e, gi, x, ep);
    };
    run4_zmm<NV, EK>(begin, end, gpr, dst, e, b, omb, load);
  });
}

// runs quantize_ef on the AVX-512 path if it takes this group size and error storage
template <int DT, typename For>
bool qef4_avx512_any(For&& parallel, const void* g, int64_t n, int64_t row_len, int64_t cpad, int64_t nrows,
                     int64_t G, float b, float omb, const Dest& dst, const ErrBuf& e) {
  const bool i8 = e.kind == kErrInt8;
  if (!i8 && e.kind != kErrNone) return false;
  if (G == 64) {
    if (i8) qef4_avx512<DT, 4, kErrInt8>(parallel, g, n, row_len, cpad, nrows, b, omb, dst, e);
    else qef4_avx512<DT, 4, kErrNone>(parallel, g, n, row_len, cpad, nrows, b, omb, dst, e);
  } else if (G == 128) {
    if (i8) qef4_avx512<DT, 8, kErrInt8>(parallel, g, n, row_len, cpad, nrows, b, omb, dst, e);
    else qef4_avx512<DT, 8, kErrNone>(parallel, g, n, row_len, cpad, nrows, b, omb, dst, e);
  } else {
    return false;  // larger groups do not fit the registers
  }
  return true;
}
#endif

// ---- whole operators; parallel(ngroups, fn(begin, end)) runs groups, maybe on several threads ----

// g (n elements) in rows of row_len, padded to cpad; row r's codes/scales go to dst row r
template <int DT, int BITS, typename For>
void quantize_ef(For&& parallel, const void* g, int64_t n, int64_t row_len, int64_t cpad, int64_t nrows, int64_t G,
                 float b, float omb, const Dest& dst, const Err& e) {
#if LOCO_AVX512
  if constexpr (BITS == 4)
    if (qef4_avx512_any<DT>(parallel, g, n, row_len, cpad, nrows, G, b, omb, dst, e)) return;
#endif
  const int64_t gpr = cpad / G, per_block = kBlock / G;
  parallel(gpr * nrows, [&](int64_t begin, int64_t end) {
    Scratch sc;
    GroupCursor at(begin, gpr);
    int64_t row = -1, row_valid = 0;
    uint8_t* qr = nullptr;
    float* sr = nullptr;
    for (int64_t gi0 = begin; gi0 < end; gi0 += per_block) {
      const int64_t nb = std::min(per_block, end - gi0);
      for (int64_t k = 0; k < nb; ++k, at.next()) {
        if (at.r != row) {
          row = at.r;
          row_valid = std::min(row_len, std::max<int64_t>(0, n - row * row_len));
          qr = q_row(dst, row);
          sr = s_row(dst, row);
        }
        const int64_t valid = std::min(G, std::max<int64_t>(0, row_valid - at.j * G));
        sc.m[k] = load_group<DT>(sc.x + k * G, sc.ep + k * G, g, row * row_len + at.j * G, valid, gi0 + k, G, e);
        sc.q[k] = qr + at.j * G * BITS / 8;
        sc.sd[k] = sr + at.j;
      }
      encode_block<BITS>(sc, nb, gi0, G, b, omb, e);
    }
  });
}

}  // namespace cpu
}  // namespace loco
