// What a programmatic dependent launch (PDL) costs or saves between small kernels in a CUDA graph,
// apart from any dflashgen kernel: chains of spin kernels (each CTA spins `ns` nanoseconds) captured
// from one stream, per kernel time = graph time / launches (CUDA events, median of 15 replays).
// Patterns (one letter per launch, repeated; P: launched with programmatic stream serialization and
// executing griddepcontrol.wait first; p: the same with half its spin before the wait (work that does
// not depend on the previous kernel); r: a plain launch that releases its dependents at its start;
// n: a plain launch that does not):
//   nnn  every launch plain                 rPn  the GDN decode chain (gdn_io -> replaying step -> gate)
//   rpn  the same with the step's early work      rrr plain launches that release (no PDL secondaries)
//   PPP  every launch a PDL secondary (waits first), releasing at its start
// and issue-bound FMA primaries (a / A: A releases at its start) followed by a waiting PDL secondary
// of 1056 CTAs (W) or a plain 1-us kernel (n): whether CTAs blocked in griddepcontrol.wait slow the
// kernel they wait for
// Build / run: nvcc -std=c++17 -O3 -arch=sm_90 tools/pdl_probe.cu -o /tmp/pdl_probe && /tmp/pdl_probe
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e = (x);                                                                   \
    if (e != cudaSuccess) {                                                                \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));         \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

__device__ __forceinline__ void spin(long long ns) {
  long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 >= ns) break;
  }
}

// mode bit 0: release dependents at the start; bit 1: wait (griddepcontrol.wait) after `pre` ns;
// bit 2: instead of spinning, `ns` dependent FMAs per thread (issue-bound work, which anything else
// issuing on the SM slows down, unlike a timer spin)
__global__ void spin_kernel(int mode, long long pre, long long ns, int* sink) {
  if (mode & 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (mode & 2) {
    spin(pre);
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  if (mode & 4) {
    float a = threadIdx.x * 1e-3f, b = 0.999f;
#pragma unroll 16
    for (long long i = 0; i < ns; ++i) a = fmaf(a, b, 1e-3f);
    if (a == 12345.f) sink[blockIdx.x] = 1;
    return;
  }
  spin(ns);
  if (threadIdx.x == 0 && ns < 0) sink[blockIdx.x] = 1;  // never: keeps the kernel from being empty
}

static void launch(char kind, int ctas, long long ns, int* sink, cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(128);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  int mode = 0;
  long long pre = 0, work = ns;
  if (kind == 'P' || kind == 'p') {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    mode = 3;
    if (kind == 'p') pre = ns / 2, work = ns - ns / 2;
  } else if (kind == 'r') {
    mode = 1;
  } else if (kind == 'A' || kind == 'a') {  // FMA work: 'A' releases its dependents at its start
    mode = kind == 'A' ? 5 : 4;
    ctas = 1056;
  } else if (kind == 'W') {  // a PDL secondary that only waits (many CTAs) and spins 1 us
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    mode = 3;
    ctas = 1056;
    work = 1000;
    cfg.gridDim = dim3(ctas);
  }
  cfg.gridDim = dim3(ctas);
  CK(cudaLaunchKernelEx(&cfg, spin_kernel, mode, pre, work, sink));
}

// Median per-`per` time (us) of a graph captured from `s` by `capture` (15 timed replays after one warm-up).
template <class F>
static float graph_us(cudaStream_t s, F&& capture, int per) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  capture();
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  std::vector<float> t;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int k = 0; k < 15; ++k) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e3f / per);
  }
  std::sort(t.begin(), t.end());
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return t[t.size() / 2];
}

int main() {
  int* sink;
  CK(cudaMalloc(&sink, 1 << 16));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::vector<std::string> patterns = {"nnn", "rPn", "rpn", "rrr", "PPP", "nPn", "rPP"};
  // issue-bound primaries (8 CTAs of 4 warps per SM, `ns` dependent FMAs per thread) followed by a
  // waiting PDL secondary of as many CTAs ('W'), vs a plain one ('n' spin 1 us), vs none: does a CTA
  // blocked in griddepcontrol.wait take issue slots from the kernel it waits for?
  for (long long iters : {4000LL, 16000LL}) {
    for (const std::string pat : {"an", "AW", "aW", "a", "A"}) {
      const float us = graph_us(s, [&] {
        for (int i = 0; i < 48; ++i)
          for (char c : pat) launch(c, 132, c == 'n' ? 1000 : iters, sink, s);
      }, 48);
      std::printf("fma %6lld  %-4s  us per pattern %8.2f\n", iters, pat.c_str(), us);
    }
  }
  const int reps = 48;  // a forward's GDN layers
  std::printf("pattern  ctas  spin_ns  us_per_launch  (each pattern: %d repeats of its 3 launches in one graph)\n",
              reps);
  for (int ctas : {132, 264, 1056}) {
    for (long long ns : {2000LL, 8000LL}) {
      for (const auto& pat : patterns) {
        const float us = graph_us(s, [&] {
          for (int i = 0; i < reps; ++i)
            for (char c : pat) launch(c, ctas, ns, sink, s);
        }, reps * static_cast<int>(pat.size()));
        std::printf("%-7s  %4d  %7lld  %8.2f\n", pat.c_str(), ctas, ns, us);
      }
    }
  }
  return 0;
}
