// CUDA implementations of the loco:: operators (schemas in loco_ops.cpp): argument checks
// (loco_torch.h, shared with the CPU operators) and launches of the kernels of loco_kernels.cu
// on the current stream.
//
// Only device-generic c10 headers are used (DeviceGuard, the stream's native handle), not
// c10/cuda, so this file also compiles against a CPU-only torch (the compile-only check).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "loco_kernels.cuh"
#include "loco_torch.h"

namespace loco {
namespace {

cudaStream_t current_stream(const c10::Device& device) {
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return static_cast<cudaStream_t>(impl.getStream(device).native_handle());
}

void check_launch(cudaError_t status, const char* what) {
  TORCH_CHECK(status == cudaSuccess, "loco: launching ", what, " failed: ", cudaGetErrorString(status));
}

// The dispatcher picks these implementations when any argument is a CUDA tensor, even an empty
// one: the tensor the others are checked against must itself be on a CUDA device.
void check_cuda(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda(), "loco: the CUDA operator got ", what, " on device ", t.device(),
              "; all its tensors must be on one CUDA device");
}

// LOCO_CUDA_VARIANT is read at every launch (the kernels' choice is in loco_kernels.cu): a value
// that names no variant is an error rather than a silent default.
void check_variant() {
  const char* v = std::getenv("LOCO_CUDA_VARIANT");
  TORCH_CHECK(v == nullptr || *v == '\0' || std::strcmp(v, "vec16") == 0 || std::strcmp(v, "warp") == 0,
              "loco: LOCO_CUDA_VARIANT='", v == nullptr ? "" : v,
              "' names no kernel variant; accepted: 'vec16' (the default: 16 bytes per lane per access) "
              "or 'warp' (the earlier kernels, 1-2 bytes per lane)");
}

void check_groups(int64_t ngroups) {
  TORCH_CHECK(ngroups <= cuda::kMaxGroups, "loco: ", ngroups, " groups are more than one launch covers (",
              cuda::kMaxGroups, "); split the tensor");
}

void quantize_ef_cuda(const at::Tensor& g_in, const at::Tensor& e, const at::Tensor& e_scale, double beta,
                      int64_t bits, int64_t group_size, int64_t row_len, const at::Tensor& q, const at::Tensor& scale) {
  check_params(bits, group_size);
  check_variant();
  check_cuda(g_in, "g");
  const c10::DeviceGuard guard(g_in.device());
  const int64_t G = group_size;
  const at::Tensor g = g_in.contiguous();
  const QefShape shape = qef_shape(g, q, row_len, G);
  for (const auto* t : {&e, &e_scale, &q, &scale}) check_device(*t, g, "every tensor");
  cuda::QefArgs a{};
  a.g = g.data_ptr();
  a.dtype = dtype_code(g, "g");
  a.n = shape.n;
  a.row_len = row_len;
  a.cpad = shape.cpad;
  a.ngroups = shape.cpad / G * shape.nrows;
  check_groups(a.ngroups);
  a.b = static_cast<float>(beta);
  a.omb = static_cast<float>(1.0 - beta);
  a.dst = dest_of(q, scale, shape.nrows, shape.cpad * bits / 8, shape.cpad / G);
  a.err = error_of(e, e_scale, shape.cpad * shape.nrows, G);
  check_launch(cuda::launch_quantize_ef(static_cast<int>(bits), static_cast<int>(G), a, current_stream(g.device())),
               "quantize_ef");
}

void dequant_reduce_requant_cuda(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& e,
                                 const at::Tensor& e_scale, double beta, int64_t bits, int64_t group_size,
                                 const at::Tensor& q_out, const at::Tensor& scale_out) {
  check_params(bits, group_size);
  check_variant();
  check_cuda(q, "q");
  const c10::DeviceGuard guard(q.device());
  const int64_t G = group_size;
  int64_t M = 0;
  const Rows rows = rows_of(q, scale, bits, G, &M);
  check_groups(M / G);
  const int64_t gpr = requant_rows(q_out, M, G);
  for (const auto* t : {&e, &e_scale, &q_out, &scale_out}) check_device(*t, q, "every tensor");
  const Dest dst = dest_of(q_out, scale_out, q_out.size(0), gpr * G * bits / 8, gpr);
  const ErrBuf err = error_of(e, e_scale, M, G);
  check_launch(cuda::launch_dequant_reduce_requant(static_cast<int>(bits), static_cast<int>(G), rows, M / G, gpr,
                                                   static_cast<float>(beta), static_cast<float>(1.0 - beta), dst, err,
                                                   current_stream(q.device())),
               "dequant_reduce_requant");
}

void dequant_reduce_cuda(const at::Tensor& q, const at::Tensor& scale, int64_t bits, int64_t group_size,
                         double divisor, const at::Tensor& out) {
  check_params(bits, group_size);
  check_variant();
  check_cuda(q, "q");
  const c10::DeviceGuard guard(q.device());
  int64_t M = 0;
  const Rows rows = rows_of(q, scale, bits, group_size, &M);
  check_groups((out.numel() + group_size - 1) / group_size);
  TORCH_CHECK(out.is_contiguous() && out.numel() <= M, "loco: out must be contiguous with at most ", M,
              " elements, got ", out.numel());
  check_device(out, q, "out");
  check_launch(cuda::launch_dequant_reduce(static_cast<int>(bits), static_cast<int>(group_size), rows,
                                           static_cast<float>(divisor), out.data_ptr(), dtype_code(out, "out"),
                                           out.numel(), current_stream(q.device())),
               "dequant_reduce");
}

}  // namespace
}  // namespace loco

TORCH_LIBRARY_IMPL(loco, CUDA, m) {
  m.impl("quantize_ef", &loco::quantize_ef_cuda);
  m.impl("dequant_reduce_requant", &loco::dequant_reduce_requant_cuda);
  m.impl("dequant_reduce", &loco::dequant_reduce_cuda);
}
