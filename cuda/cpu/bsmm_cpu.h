// CPU kernels of the bsmm products (the problems of bsmm_problem.h, host pointers).
//
// bsmm_cpu_kernels.cc is compiled once per instruction set (build.py: a portable
// baseline, and on x86-64 also AVX2+FMA and AVX-512), each copy in its own namespace
// jbs::cpu::<isa>; bsmm_cpu_dispatch.cc picks the best one the running CPU supports.
// The kernel translation units include nothing but this header and bsmm_problem.h and
// use no C++ library templates, so that no inline function compiled for a wider
// instruction set can be picked by the linker for the other translation units.
//
// Work is split into independent items (output block columns or rows x row tiles for
// fprop/bprop, groups of slots for updat) handed out one at a time by a Parallel to
// its workers, longest first: that is the load balance for unbalanced layouts.
#ifndef JAX_BLOCKSPARSE_CUDA_CPU_BSMM_CPU_H_
#define JAX_BLOCKSPARSE_CUDA_CPU_BSMM_CPU_H_

#include <cstdint>

#include "bsmm_problem.h"

namespace jbs {
namespace cpu {

// Runs body(arg, i) once for every i in [0, count), on any threads, and returns when
// all have finished. Items may run in any order and concurrently.
struct Parallel {
  void* ctx;
  int workers;  // how many threads may run items at once (>= 1), for sizing the items
  void (*for_each)(void* ctx, int64_t count, void (*body)(void* arg, int64_t i), void* arg);
};

// fprop (transpose_w = false) or bprop (transpose_w = true). Returns false for an
// unsupported configuration (block size, dtype pair), having written nothing.
bool RunDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Parallel& par);
// updat.
bool RunSdd(DType in, bool out_f32, const SddParams& p, const Parallel& par);
// Name of the instruction set the dispatcher chose: "avx512", "avx2" or "baseline".
const char* KernelIsa();

#define JBS_DECLARE_CPU_KERNELS(isa)                                                              \
  namespace isa {                                                                                 \
  bool RunDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Parallel& par); \
  bool RunSdd(DType in, bool out_f32, const SddParams& p, const Parallel& par);                   \
  }

JBS_DECLARE_CPU_KERNELS(baseline)
JBS_DECLARE_CPU_KERNELS(avx2)
JBS_DECLARE_CPU_KERNELS(avx512)
#undef JBS_DECLARE_CPU_KERNELS

}  // namespace cpu
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_CPU_BSMM_CPU_H_
