/* STREAM's "Copy" kernel (c[j] = a[j] over double arrays, counted as 16 bytes per element: one
 * read, one write), for bench_loco.py to time in the same run as the LoCo kernels.  Plain loads
 * and stores: the write-allocate read of each destination line is real traffic that STREAM does
 * not count.  Built with -O3 -march=native, so gcc vectorizes the loop with this CPU's widest
 * registers (on the 2-core AMD EPYC of benchmarks/RESULTS.md, 10-20% faster than the scalar loop
 * gcc -O2 makes, and as fast as glibc's memcpy); -fno-tree-loop-distribute-patterns keeps gcc
 * from replacing the loop with a memcpy call.  Threads are pthreads, each copying one contiguous
 * slice, so the benchmark needs no second OpenMP runtime beside torch's.  Built by bench_loco.py:
 *   gcc -O3 -march=native -fno-tree-loop-distribute-patterns -fPIC -shared -pthread \
 *       stream_copy.c -o stream_copy.so */
#include <pthread.h>

struct slice {
  const double* a;
  double* c;
  long n;
};

static void* copy_slice(void* p) {
  const struct slice* s = (const struct slice*)p;
  const double* restrict a = s->a;
  double* restrict c = s->c;
  for (long j = 0; j < s->n; j++) c[j] = a[j];
  return 0;
}

/* c[0..n) = a[0..n) on `threads` threads (1..64); returns 0, or -1 if a thread failed to start */
int stream_copy(const double* a, double* c, long n, int threads) {
  pthread_t ids[64];
  struct slice parts[64];
  int started = 0, rc = 0;
  if (threads < 1) threads = 1;
  if (threads > 64) threads = 64;
  for (int t = 0; t < threads; t++) {
    long lo = n * t / threads, hi = n * (t + 1) / threads;
    parts[t].a = a + lo;
    parts[t].c = c + lo;
    parts[t].n = hi - lo;
  }
  for (int t = 1; t < threads; t++) {
    if (pthread_create(&ids[t], 0, copy_slice, &parts[t]) != 0) {
      rc = -1;
      break;
    }
    started = t;
  }
  copy_slice(&parts[0]);
  for (int t = 1; t <= started; t++) pthread_join(ids[t], 0);
  return rc;
}
