// Launchers of the LoCo CUDA kernels (loco_kernels.cu), called by loco_cuda.cpp.
// Plain C++ types only, so the kernels compile with nvcc without the torch headers.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "loco_common.h"

namespace loco {
namespace cuda {

constexpr int kWarpsPerBlock = 8;  // one warp per group, 8 groups per block of 256 threads
// groups one launch covers: a grid has at most 2^31 - 1 blocks in x
constexpr int64_t kMaxGroups = static_cast<int64_t>(0x7fffffff) * kWarpsPerBlock;

// g (n elements, DType dtype) in rows of row_len padded to cpad; ngroups = cpad / G * rows
struct QefArgs {
  const void* g;
  int dtype;
  int64_t n, row_len, cpad, ngroups;
  float b, omb;
  Dest dst;
  ErrBuf err;
};

cudaError_t launch_quantize_ef(int bits, int group_size, const QefArgs& a, cudaStream_t stream);

// ngroups = M / G; the destination rows hold gpr groups each
cudaError_t launch_dequant_reduce_requant(int bits, int group_size, const Rows& rows, int64_t ngroups,
                                          int64_t gpr, float b, float omb, const Dest& dst, const ErrBuf& err,
                                          cudaStream_t stream);

cudaError_t launch_dequant_reduce(int bits, int group_size, const Rows& rows, float divisor, void* out,
                                  int out_dtype, int64_t n_out, cudaStream_t stream);

}  // namespace cuda
}  // namespace loco
