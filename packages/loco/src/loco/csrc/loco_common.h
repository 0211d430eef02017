// Shared definitions of the LoCo kernels (CPU and CUDA).  No torch headers: the CUDA kernels
// include this file too and compile with nvcc alone.
//
// The arithmetic is the one of loco/reference.py, step for step, in float32:
//   amax = max |x| over a group (compared as the bits of |x|: exact, and NaN/inf detectable);
//   non-finite group -> scale = +inf, codes 0;  amax < 2^-100 -> scale = 0, codes 0;
//   else scale = amax / qmax, code = clamp(rint(x * (qmax / amax)), -qmax, qmax);
//   e_new = beta * e + (1 - beta) * (x - code * scale).
#pragma once

#include <stdint.h>

namespace loco {

// dtype of a gradient / output tensor
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
// storage of an error buffer
enum ErrKind : int { kErrNone = 0, kErrInt8 = 1, kErrBF16 = 2, kErrF32 = 3 };

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;   // |x| bits >= this: inf or NaN
constexpr uint32_t kTinyBits = 0x0d800000u;  // bits of 2^-100
constexpr int kMaxGroup = 1024;

// An error buffer, read and overwritten in place one group at a time.
struct ErrBuf {
  int kind;       // ErrKind
  void* data;     // int8 codes, bf16 or fp32 values
  float* scale;   // int8: one scale per group
};

// Where the codes and scales of destination row r = a * B + b go: q + a * q_stride0 +
// b * q_stride1 (and the same for the scales), so rows can land in an all-to-all send buffer
// in any order.
struct Dest {
  uint8_t* q;
  int64_t q_stride0, q_stride1;
  float* scale;
  int64_t s_stride0, s_stride1;
  int64_t B;
};

// Source rows of packed codes: S rows, strides in bytes / floats.
struct Rows {
  const uint8_t* q;
  int64_t q_stride;
  const float* scale;
  int64_t s_stride;
  int64_t S;
};

}  // namespace loco
