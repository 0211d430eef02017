// Throughput of single 512-bit instructions and of pairs of them on this CPU: which ones share
// execution pipes.  Each loop iteration runs 8 independent copies of the instruction (or pair) on
// different destination registers, so only throughput counts, not latency.  Prints cycles per
// instruction (per pair for "a+b"), from wall time and the clock measured first with a chain of
// dependent integer adds (one per cycle).  Used to explain the loco kernels' limits in
// benchmarks/RESULTS.md ("CPU kernels").  Build and run (needs AVX-512F/BW):
//   gcc -O2 -mavx512f -mavx512bw benchmarks/zmm_pairs.c -o /tmp/zmm_pairs && /tmp/zmm_pairs
// Two instructions that run at 1 per cycle alone and 1 pair per cycle together use different
// pipes; 2 cycles per pair means they share them.
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static double ghz(void) {
  const long n = 500000000;
  long x = 0;
  double t = now();
  for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  return 4.0 * n / (now() - t) / 1e9;
}

#define EIGHT(I) I(16) I(17) I(18) I(19) I(20) I(21) I(22) I(23)
#define CLOBBER "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23"
#define TIME(name, INS)                                                     \
  {                                                                         \
    const long n = 20000000;                                                \
    double t = now();                                                       \
    for (long i = 0; i < n; i++) __asm__ volatile(EIGHT(INS)::: CLOBBER);  \
    t = now() - t;                                                          \
    printf("%-26s %.2f\n", name, t * f * 1e9 / (n * 8.0));                  \
  }

#define MUL(r) "vmulps %%zmm1, %%zmm2, %%zmm" #r "\n\t"
#define ADD(r) "vaddps %%zmm1, %%zmm2, %%zmm" #r "\n\t"
#define FMA(r) "vfmadd231ps %%zmm1, %%zmm2, %%zmm" #r "\n\t"
#define RND(r) "vrndscaleps $8, %%zmm1, %%zmm" #r "\n\t"
#define CVT(r) "vcvtdq2ps %%zmm1, %%zmm" #r "\n\t"
#define CVT2(r) "vcvtps2dq %%zmm1, %%zmm" #r "\n\t"
#define PERM(r) "vpermps %%zmm1, %%zmm2, %%zmm" #r "\n\t"
#define ZX(r) "vpmovzxbd %%xmm1, %%zmm" #r "\n\t"
#define DB(r) "vpmovdb %%zmm1, %%xmm" #r "\n\t"
#define SRL(r) "vpsrld $4, %%zmm1, %%zmm" #r "\n\t"
#define MAXU(r) "vpmaxud %%zmm1, %%zmm2, %%zmm" #r "\n\t"
#define TERN(r) "vpternlogd $0xca, %%zmm1, %%zmm2, %%zmm" #r "\n\t"
#define PAIR(A, B, r) A(r) B(r)
#define ADD_MUL(r) PAIR(ADD, MUL, r)
#define CVT_ADD(r) PAIR(CVT, ADD, r)
#define CVT_MUL(r) PAIR(CVT, MUL, r)
#define RND_ADD(r) PAIR(RND, ADD, r)
#define RND_MUL(r) PAIR(RND, MUL, r)
#define SRL_ADD(r) PAIR(SRL, ADD, r)
#define SRL_MUL(r) PAIR(SRL, MUL, r)
#define PERM_ADD(r) PAIR(PERM, ADD, r)
#define PERM_MUL(r) PAIR(PERM, MUL, r)
#define PERM_ZX(r) PAIR(PERM, ZX, r)
#define ZX_DB(r) PAIR(ZX, DB, r)
#define MAXU_ADD(r) PAIR(MAXU, ADD, r)

int main(void) {
  const double f = ghz();
  printf("clock %.2f GHz; cycles per instruction (per pair for a+b), 512-bit registers\n", f);
  TIME("vmulps", MUL) TIME("vaddps", ADD) TIME("vfmadd231ps", FMA) TIME("vrndscaleps", RND)
  TIME("vcvtdq2ps", CVT) TIME("vcvtps2dq", CVT2) TIME("vpermps", PERM) TIME("vpmovzxbd", ZX)
  TIME("vpmovdb", DB) TIME("vpsrld", SRL) TIME("vpmaxud", MAXU) TIME("vpternlogd", TERN)
  TIME("vaddps+vmulps", ADD_MUL) TIME("vcvtdq2ps+vaddps", CVT_ADD) TIME("vcvtdq2ps+vmulps", CVT_MUL)
  TIME("vrndscaleps+vaddps", RND_ADD) TIME("vrndscaleps+vmulps", RND_MUL) TIME("vpsrld+vaddps", SRL_ADD)
  TIME("vpsrld+vmulps", SRL_MUL) TIME("vpermps+vaddps", PERM_ADD) TIME("vpermps+vmulps", PERM_MUL)
  TIME("vpermps+vpmovzxbd", PERM_ZX) TIME("vpmovzxbd+vpmovdb", ZX_DB) TIME("vpmaxud+vaddps", MAXU_ADD)
  return 0;
}
