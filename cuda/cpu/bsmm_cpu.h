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
  int64_t macs = 0;  // the multiply-adds of the call it was chosen for (cpu::Workers)
};

// fprop (transpose_w = false) or bprop (transpose_w = true). Returns false for an
// unsupported configuration (block size, dtype pair), having written nothing.
bool RunDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Parallel& par);
// updat.
bool RunSdd(DType in, bool out_f32, const SddParams& p, const Parallel& par);
// Name of the instruction set the kernels run: "amx", "avx512_bf16", "avx512", "avx2" or
// "baseline". The widest the CPU supports, or the lower one the environment variable
// JAX_BLOCKSPARSE_CPU_ISA names (read at every call, so that tests and benchmarks can
// compare them in one process).
const char* KernelIsa();
// The widest instruction set this CPU supports (and, for "amx", this process may use).
const char* DetectedIsa();
// The instruction sets' names from the lowest ("baseline") to the widest ("amx"): i < count.
int IsaCount();
const char* IsaName(int i);
// Why JAX_BLOCKSPARSE_CPU_ISA cannot be honoured (an unknown name, or one this CPU lacks),
// or nullptr when it is unset or valid. The handlers fail with it rather than run another.
const char* IsaOverrideError();

#define JBS_DECLARE_CPU_KERNELS(isa)                                                              \
  namespace isa {                                                                                 \
  bool RunDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Parallel& par); \
  bool RunSdd(DType in, bool out_f32, const SddParams& p, const Parallel& par);                   \
  }

JBS_DECLARE_CPU_KERNELS(baseline)
JBS_DECLARE_CPU_KERNELS(avx2)
JBS_DECLARE_CPU_KERNELS(avx512)
#undef JBS_DECLARE_CPU_KERNELS

// The bfloat16 kernels of the matrix units (bsmm_cpu_bf16.cc, x86-64 builds that define
// JBS_CPU_BF16_KERNELS): AMX tiles, or AVX512-BF16 dot products. bfloat16 operands and
// blocks of kMinBlock or more only (false, having written nothing, for smaller ones);
// out_f32 as above.
namespace bf16 {
// Block 8 stays on the widening AVX-512 kernels: 8 columns fill neither an AMX tile nor a
// 512-bit dot product, and a 256-bit VDPBF16PS form measured 2-4x slower than them
// (bench/bsmm.py --preset crossover-cpu, 2026-11-26).
constexpr int kMinBlock = 16;
enum class Engine { kAmx, kDot };
bool RunDsd(Engine engine, bool out_f32, bool transpose_w, const DsdParams& p, const Parallel& par);
bool RunSdd(Engine engine, bool out_f32, const SddParams& p, const Parallel& par);
// Runs `steps` x 4 TDPBF16PS on operands held in the tiles (no memory traffic) on the
// calling thread and returns the FLOPs done: divided by the time, the unit's peak.
double TilePeakFlops(int64_t steps);
}  // namespace bf16
// TilePeakFlops where the build has the AMX kernels and this process may use them (the
// detected instruction set is "amx"), else -1.
double AmxPeakProbe(int64_t steps);

}  // namespace cpu
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_CPU_BSMM_CPU_H_
