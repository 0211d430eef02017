// A/B driver of loco's CPU kernels (no torch): two versions of the headers compiled into one
// binary (namespaces A and B) and timed alternately, single thread, CPU time, so both see the
// same machine load; prints per kernel the median over rounds of the old/new time ratio of each
// adjacent pair, and the median and best ns/element of each version.  Build and run:
//   mkdir -p /tmp/ab/base && git show <rev>:packages/loco/src/loco/csrc/loco_cpu.h > /tmp/ab/base/loco_cpu.h
//   (same for loco_cpu_recv.h and loco_common.h); ln -s $PWD/packages/loco/src/loco/csrc /tmp/ab/new
//   g++ -O3 -ffp-contract=off -fno-math-errno -fno-trapping-math <ISA> -std=c++20 \
//       -I /tmp/ab benchmarks/loco_kernels_ab.cpp -o /tmp/loco_ab
//   /tmp/loco_ab [elements = 16M] [rounds = 9] [divisor = 2]
// <ISA>: the extension's flags (loco.ops.cpu_build_flags()): -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mf16c where torch reports an AVX-512 CPU (the kernels' AVX-512 paths), else
// -mavx2 -mfma -mf16c.  Where both versions are copies (no symlink), give them different
// modification times: GCC's #pragma once takes two files with the same contents and mtime for one.
// (the system headers are included first, so that the wrapped copies only add loco's own code)
#include <stdint.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <time.h>
#include "loco_kernels_inputs.h"
namespace A {
#include "base/loco_cpu_recv.h"
}
namespace B {
#include "new/loco_cpu_recv.h"
}
int main(int argc, char** argv){
  const int64_t n = argc > 1 ? atoll(argv[1]) : (1<<24), G=128; const int R = argc > 2 ? atoi(argv[2]) : 9;
  const float div = argc > 3 ? atof(argv[3]) : 2.f;
  KernelInputs in(n, G);
  auto& g = in.g; auto& e = in.e; auto& es = in.es; auto& q = in.q; auto& s = in.s;
  auto& rq = in.rq; auto& rs = in.rs; auto& out = in.out;
  A::loco::ErrBuf ea{A::loco::kErrInt8, e.data(), es.data()}; B::loco::ErrBuf eb{B::loco::kErrInt8, e.data(), es.data()};
  A::loco::Dest da{q.data(), n/2, 0, s.data(), n/G, 0, 1}; B::loco::Dest db{q.data(), n/2, 0, s.data(), n/G, 0, 1};
  A::loco::Rows ra{rq.data(), n/2, rs.data(), n/G, 2}; B::loco::Rows rb{rq.data(), n/2, rs.data(), n/G, 2};
  std::vector<double> T[6];
  auto t1=[&](auto fn){ fn(); double t=cpu_now(); fn(); return (cpu_now()-t)/n*1e9; };
  for(int r=0;r<R;++r){
    T[0].push_back(t1([&]{ A::loco::cpu::quantize_ef<A::loco::kBF16,4>(Serial{}, g.data(), n, n, n, 1, G, 0.8f, 0.2f, da, ea); }));
    T[1].push_back(t1([&]{ B::loco::cpu::quantize_ef<B::loco::kBF16,4>(Serial{}, g.data(), n, n, n, 1, G, 0.8f, 0.2f, db, eb); }));
    T[2].push_back(t1([&]{ A::loco::cpu::dequant_reduce_requant<4>(Serial{}, ra, n, G, 0.8f, 0.2f, n/G, da, ea); }));
    T[3].push_back(t1([&]{ B::loco::cpu::dequant_reduce_requant<4>(Serial{}, rb, n, G, 0.8f, 0.2f, n/G, db, eb); }));
    T[4].push_back(t1([&]{ A::loco::cpu::dequant_reduce<A::loco::kBF16,4>(Serial{}, ra, G, div, out.data(), n); }));
    T[5].push_back(t1([&]{ B::loco::cpu::dequant_reduce<B::loco::kBF16,4>(Serial{}, rb, G, div, out.data(), n); }));
  }
  const char* nm[3]={"qef","drr","dr"};
  for(int k=0;k<3;++k){ auto a=T[2*k], b=T[2*k+1]; std::sort(a.begin(),a.end()); std::sort(b.begin(),b.end());
    std::vector<double> rr; for(int r=0;r<R;++r) rr.push_back(T[2*k][r]/T[2*k+1][r]); std::sort(rr.begin(),rr.end());
    printf("ratio(med of pairs) %.3f ", rr[R/2]);
    printf("%-4s old med %.3f min %.3f | new med %.3f min %.3f ns/elem | speedup(min) %.2f\n", nm[k], a[R/2], a[0], b[R/2], b[0], a[0]/b[0]); }
}
