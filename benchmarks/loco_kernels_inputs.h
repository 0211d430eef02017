// Shared by the standalone loco kernel drivers (loco_kernels_driver.cpp, loco_kernels_ab.cpp):
// the random inputs of the three CPU kernels, a thread CPU-time clock and a serial "parallel for".
// No loco types here, so the A/B driver can include it once for both namespaced versions.
#pragma once
#include <stdint.h>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <time.h>

static double cpu_now() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

struct Serial { template <class F> void operator()(int64_t n, F&& f) const { f(0, n); } };

// n bf16 gradients, an int8 error buffer with group scales, the 4-bit output with its scales,
// two received 4-bit rows with their scales, and a bf16 output (group size G)
struct KernelInputs {
  int64_t n, G;
  std::vector<uint16_t> g; std::vector<int8_t> e; std::vector<float> es;
  std::vector<uint8_t> q; std::vector<float> s;
  std::vector<uint8_t> rq; std::vector<float> rs;
  std::vector<uint16_t> out;
  KernelInputs(int64_t n_, int64_t G_)
      : n(n_), G(G_), g(n_), e(n_), es(n_ / G_, 0.001f), q(n_ / 2), s(n_ / G_), rq(n_), rs(2 * n_ / G_, 0.01f), out(n_) {
    for (int64_t i = 0; i < n; ++i) { float v = (float)((rand() % 20001) - 10000) / 977.f; uint32_t u; memcpy(&u, &v, 4); g[i] = u >> 16; }
    for (auto& x : e) x = (rand() % 255) - 127;
    for (auto& x : rq) x = rand();
  }
};
