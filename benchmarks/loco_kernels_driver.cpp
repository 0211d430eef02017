// Standalone driver of loco's CPU kernels (no torch): single-thread CPU time of each kernel on
// 16 M elements, against memcpy of a 128 MiB buffer.  Build and run (see benchmarks/RESULTS.md):
//   g++ -O3 -ffp-contract=off -fno-math-errno -fno-trapping-math -mavx2 -mfma -mf16c -std=c++17 \
//       -I packages/loco/src/loco/csrc benchmarks/loco_kernels_driver.cpp -o /tmp/loco_driver
//   /tmp/loco_driver
// To compare with another version of the kernels, point -I at a folder holding that version's
// loco_cpu.h, loco_cpu_recv.h (if it has one) and loco_common.h.
#if __has_include("loco_cpu_recv.h")
#include "loco_cpu_recv.h"
#else
#include "loco_cpu.h"
#endif
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <time.h>
#include "loco_kernels_inputs.h"
using namespace loco;
int main(){
  const int64_t n = 1<<24, G=128;
  KernelInputs in(n, G);
  auto& g = in.g; auto& e = in.e; auto& es = in.es; auto& q = in.q; auto& s = in.s;
  auto& rq = in.rq; auto& rs = in.rs; auto& out = in.out;
  std::vector<float> src(1<<25, 1.f), dst(1<<25);
  ErrBuf eb{kErrInt8, e.data(), es.data()};
  Dest d{q.data(), 0, 0, s.data(), 0, 0, 1}; // single row
  d.q_stride0 = n/2; d.s_stride0 = n/G; d.q_stride1=0; d.s_stride1=0;
  Rows rows{rq.data(), n/2, rs.data(), n/G, 2};
  auto best=[&](auto fn){ double b=1e9; for(int r=0;r<5;++r){ double t=cpu_now(); fn(); b=std::min(b,cpu_now()-t);} return b; };
  double tc = best([&]{ memcpy(dst.data(), src.data(), 4*src.size()); });
  double copy_bw = 2.0*4*src.size()/tc;
  double sb = 4.0*n/G;
  double tq = best([&]{ cpu::quantize_ef<kBF16,4>(Serial{}, g.data(), n, n, n, 1, G, 0.8f, 0.2f, d, eb); });
  double mq = n*2 + (n+sb)*2 + n/2 + sb;
  double tr = best([&]{ cpu::dequant_reduce_requant<4>(Serial{}, rows, n, G, 0.8f, 0.2f, n/G, d, eb); });
  double mr = 2*(n/2+sb) + (n+sb)*2 + n/2 + sb;
  double td = best([&]{ cpu::dequant_reduce<kBF16,4>(Serial{}, rows, G, 2.0f, out.data(), n); });
  double md = 2*(n/2+sb) + 2.0*n;
  printf("copy %.2f GB/s\nquantize_ef %.2f GB/s frac %.2f  (%.2f ns/elem)\ndrr %.2f GB/s frac %.2f (%.2f ns/elem)\ndr %.2f GB/s frac %.2f (%.2f ns/elem)\n",
    copy_bw/1e9, mq/tq/1e9, mq/tq/copy_bw, tq/n*1e9, mr/tr/1e9, mr/tr/copy_bw, tr/n*1e9, md/td/1e9, md/td/copy_bw, td/n*1e9);
}
