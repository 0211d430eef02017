// The loco:: operators: their schemas, and their CPU implementation.
//
// quantize_ef             error feedback + quantization of a gradient (sender side)
// dequant_reduce_requant  sum of S quantized rows + error feedback + requantization (2nd hop)
// dequant_reduce          sum of S quantized rows / divisor (receiver side)
//
// All three write into tensors the caller provides (the codes may go straight into a strided
// view of an all-to-all send buffer) and update the error buffer in place, so nothing is
// allocated per call.  The arithmetic lives in loco_cpu.h (sender side) and loco_cpu_recv.h (receiver side), one quantization group at a time,
// vectorized); this file checks the arguments and spreads groups over threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "loco_cpu_recv.h"
#include "loco_torch.h"

namespace loco {
namespace {


// at::parallel_for over groups, at least ~32k elements per task
struct Parallel {
  int64_t G;
  template <typename F>
  void operator()(int64_t ngroups, F&& fn) const {
    at::parallel_for(0, ngroups, std::max<int64_t>(1, 32768 / G), fn);
  }
};

void quantize_ef_cpu(const at::Tensor& g_in, const at::Tensor& e, const at::Tensor& e_scale, double beta, int64_t bits,
                     int64_t group_size, int64_t row_len, const at::Tensor& q, const at::Tensor& scale) {
  check_params(bits, group_size);
  const int64_t G = group_size;
  const at::Tensor g = g_in.contiguous();
  const auto [n, cpad, nrows] = qef_shape(g, q, row_len, G);
  for (const auto* t : {&e, &e_scale, &q, &scale}) check_device(*t, g, "every tensor");
  const Dest dst = dest_of(q, scale, nrows, cpad * bits / 8, cpad / G);
  const ErrBuf err = error_of(e, e_scale, cpad * nrows, G);
  const float b = static_cast<float>(beta), omb = static_cast<float>(1.0 - beta);
  const void* gp = g.data_ptr();
  const int dt = dtype_code(g, "g");
#define LOCO_QEF(DT, BITS) cpu::quantize_ef<DT, BITS>(Parallel{G}, gp, n, row_len, cpad, nrows, G, b, omb, dst, err)
  if (bits == 4) {
    if (dt == kF32) LOCO_QEF(kF32, 4); else if (dt == kBF16) LOCO_QEF(kBF16, 4); else LOCO_QEF(kF16, 4);
  } else {
    if (dt == kF32) LOCO_QEF(kF32, 8); else if (dt == kBF16) LOCO_QEF(kBF16, 8); else LOCO_QEF(kF16, 8);
  }
#undef LOCO_QEF
}

void dequant_reduce_requant_cpu(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& e,
                                const at::Tensor& e_scale, double beta, int64_t bits, int64_t group_size,
                                const at::Tensor& q_out, const at::Tensor& scale_out) {
  check_params(bits, group_size);
  const int64_t G = group_size;
  int64_t M = 0;
  const Rows rows = rows_of(q, scale, bits, G, &M);
  const int64_t gpr = requant_rows(q_out, M, G);
  for (const auto* t : {&e, &e_scale, &q_out, &scale_out}) check_device(*t, q, "every tensor");
  const Dest dst = dest_of(q_out, scale_out, q_out.size(0), gpr * G * bits / 8, gpr);
  const ErrBuf err = error_of(e, e_scale, M, G);
  const float b = static_cast<float>(beta), omb = static_cast<float>(1.0 - beta);
  if (bits == 4)
    cpu::dequant_reduce_requant<4>(Parallel{G}, rows, M, G, b, omb, gpr, dst, err);
  else
    cpu::dequant_reduce_requant<8>(Parallel{G}, rows, M, G, b, omb, gpr, dst, err);
}

void dequant_reduce_cpu(const at::Tensor& q, const at::Tensor& scale, int64_t bits, int64_t group_size,
                        double divisor, const at::Tensor& out) {
  check_params(bits, group_size);
  int64_t M = 0;
  const Rows rows = rows_of(q, scale, bits, group_size, &M);
  TORCH_CHECK(out.is_contiguous() && out.numel() <= M, "loco: out must be contiguous with at most ", M,
              " elements, got ", out.numel());
  check_device(out, q, "out");
  const int dt = dtype_code(out, "out");
  const float d = static_cast<float>(divisor);
  void* op = out.data_ptr();
  const int64_t n = out.numel();
  if (n == 0) return;
#define LOCO_DR(DT, BITS) cpu::dequant_reduce<DT, BITS>(Parallel{group_size}, rows, group_size, d, op, n)
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
      "quantize_ef(Tensor g, Tensor(a!) e, Tensor(b!) e_scale, float beta, int bits, int group_size, int row_len, "
      "Tensor(c!) q, Tensor(d!) scale) -> ()");
  m.def(
      "dequant_reduce_requant(Tensor q, Tensor scale, Tensor(a!) e, Tensor(b!) e_scale, float beta, int bits, "
      "int group_size, Tensor(c!) q_out, Tensor(d!) scale_out) -> ()");
  m.def("dequant_reduce(Tensor q, Tensor scale, int bits, int group_size, float divisor, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(loco, CPU, m) {
  m.impl("quantize_ef", &loco::quantize_ef_cpu);
  m.impl("dequant_reduce_requant", &loco::dequant_reduce_requant_cpu);
  m.impl("dequant_reduce", &loco::dequant_reduce_cpu);
}
