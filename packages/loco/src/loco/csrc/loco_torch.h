// Argument checks shared by the CPU (loco_ops.cpp) and CUDA (loco_cuda.cpp) operators: they turn
// tensors into the plain structs of loco_common.h that the kernels take.
#pragma once

#include <ATen/ATen.h>

#include "loco_common.h"

namespace loco {

inline void check_params(int64_t bits, int64_t G) {
  TORCH_CHECK(bits == 4 || bits == 8, "loco: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(G >= 64 && G <= kMaxGroup && (G & (G - 1)) == 0,
              "loco: group_size must be a power of two in [64, 1024], got ", G);
}

inline int dtype_code(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: TORCH_CHECK(false, "loco: ", what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return kF32;
}

inline void check_device(const at::Tensor& t, const at::Tensor& ref, const char* what) {
  TORCH_CHECK(t.numel() == 0 || t.device() == ref.device(), "loco: ", what, " must be on device ", ref.device(),
              ", got device ", t.device());
}

// The error buffer of `total` elements (empty: no error feedback).
inline ErrBuf error_of(const at::Tensor& e, const at::Tensor& e_scale, int64_t total, int64_t G) {
  ErrBuf err{kErrNone, nullptr, nullptr};
  if (e.numel() == 0) return err;
  TORCH_CHECK(e.numel() == total && e.is_contiguous(), "loco: the error buffer must be contiguous with ", total,
              " elements, got ", e.numel());
  switch (e.scalar_type()) {
    case at::kChar:
      err.kind = kErrInt8;
      TORCH_CHECK(e_scale.scalar_type() == at::kFloat && e_scale.numel() == total / G && e_scale.is_contiguous() &&
                      e_scale.device() == e.device(),
                  "loco: an int8 error buffer needs ", total / G, " contiguous float32 scales on its device");
      err.scale = e_scale.data_ptr<float>();
      break;
    case at::kBFloat16: err.kind = kErrBF16; break;
    case at::kFloat: err.kind = kErrF32; break;
    default: TORCH_CHECK(false, "loco: the error buffer must be int8, bfloat16 or float32, got ", e.scalar_type());
  }
  err.data = e.data_ptr();
  return err;
}

// Destination rows: q [A, B, bytes] uint8 and scale [A, B, groups] float32 (or 2-D [rows, ...],
// taken as B = 1), innermost dimension contiguous, other strides free.
inline Dest dest_of(const at::Tensor& q, const at::Tensor& scale, int64_t rows, int64_t row_bytes,
                    int64_t row_groups) {
  TORCH_CHECK((q.dim() == 2 || q.dim() == 3) && q.dim() == scale.dim(), "loco: q and scale must be 2-D or 3-D alike");
  TORCH_CHECK(q.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat,
              "loco: q must be uint8 and scale float32");
  const bool three = q.dim() == 3;
  const int64_t A = q.size(0), B = three ? q.size(1) : 1;
  TORCH_CHECK(A * B == rows && q.size(-1) == row_bytes && scale.size(0) == A && (!three || scale.size(1) == B) &&
                  scale.size(-1) == row_groups,
              "loco: expected q of ", rows, " rows of ", row_bytes, " bytes and scale of ", rows, " rows of ",
              row_groups, ", got ", q.sizes(), " and ", scale.sizes());
  TORCH_CHECK((row_bytes <= 1 || q.stride(-1) == 1) && (row_groups <= 1 || scale.stride(-1) == 1),
              "loco: the rows of q and scale must be contiguous");
  return Dest{q.data_ptr<uint8_t>(),     q.stride(0), three ? q.stride(1) : 0, scale.data_ptr<float>(),
              scale.stride(0), three ? scale.stride(1) : 0, B};
}

// Source rows: q [S, bytes] uint8, scale [S, groups] float32, rows contiguous; *M = elements per row
inline Rows rows_of(const at::Tensor& q, const at::Tensor& scale, int64_t bits, int64_t G, int64_t* M) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && (q.size(1) <= 1 || q.stride(1) == 1),
              "loco: q must be a 2-D uint8 tensor [sources, bytes] with contiguous rows");
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && (scale.size(1) <= 1 || scale.stride(1) == 1),
              "loco: scale must be a 2-D float32 tensor [sources, groups] with contiguous rows");
  check_device(scale, q, "scale");
  *M = q.size(1) * 8 / bits;
  TORCH_CHECK(*M % G == 0 && scale.size(0) == q.size(0) && scale.size(1) == *M / G, "loco: q holds ", *M,
              " elements per row, which needs ", *M / G, " scales per row; got ", scale.sizes());
  return Rows{q.data_ptr<uint8_t>(), q.stride(0), scale.data_ptr<float>(), scale.stride(0), q.size(0)};
}

// Shapes of a quantize_ef call: g of n elements in q's rows of row_len (padded to cpad)
struct QefShape {
  int64_t n, cpad, nrows;
};

inline QefShape qef_shape(const at::Tensor& g, const at::Tensor& q, int64_t row_len, int64_t G) {
  const int64_t n = g.numel(), cpad = (row_len + G - 1) / G * G;
  const int64_t nrows = q.dim() == 3 ? q.size(0) * q.size(1) : q.size(0);
  TORCH_CHECK(row_len >= 0 && n <= row_len * nrows, "loco: ", n, " elements do not fit ", nrows, " rows of ",
              row_len);
  return QefShape{n, cpad, nrows};
}

// q_out [rows, bytes] of whole groups for M elements; returns groups per row
inline int64_t requant_rows(const at::Tensor& q_out, int64_t M, int64_t G) {
  TORCH_CHECK(q_out.dim() == 2 && q_out.size(0) >= 1 && M % (q_out.size(0) * G) == 0,
              "loco: q_out must be 2-D with rows of whole groups (", M, " elements in all), got ", q_out.sizes());
  return M / G / q_out.size(0);
}

}  // namespace loco
