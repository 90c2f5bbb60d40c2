// Picks the widest compiled instruction set the running CPU supports (once).
//
// The build compiles the kernel files (bsmm_cpu_kernels.cc, bsconv_cpu_kernels.cc) for
// "baseline" everywhere and, on x86-64 (where it defines JBS_CPU_X86_VARIANTS), also for
// "avx2" (AVX2 + FMA) and "avx512" (AVX-512F).
#include "cpu/bsconv_cpu.h"
#include "cpu/bsmm_cpu.h"

namespace jbs {
namespace cpu {
namespace {

enum class Isa { kBaseline, kAvx2, kAvx512 };

Isa DetectIsa() {
#if defined(JBS_CPU_X86_VARIANTS) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

Isa ChosenIsa() {
  static const Isa isa = DetectIsa();
  return isa;
}

}  // namespace

bool RunDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Parallel& par) {
  switch (ChosenIsa()) {
#if defined(JBS_CPU_X86_VARIANTS)
    case Isa::kAvx512: return avx512::RunDsd(in, out_f32, transpose_w, p, par);
    case Isa::kAvx2: return avx2::RunDsd(in, out_f32, transpose_w, p, par);
#endif
    default: return baseline::RunDsd(in, out_f32, transpose_w, p, par);
  }
}

bool RunSdd(DType in, bool out_f32, const SddParams& p, const Parallel& par) {
  switch (ChosenIsa()) {
#if defined(JBS_CPU_X86_VARIANTS)
    case Isa::kAvx512: return avx512::RunSdd(in, out_f32, p, par);
    case Isa::kAvx2: return avx2::RunSdd(in, out_f32, p, par);
#endif
    default: return baseline::RunSdd(in, out_f32, p, par);
  }
}

bool RunConv(DType in, bool out_f32, const ConvParams& p, const Parallel& par) {
  switch (ChosenIsa()) {
#if defined(JBS_CPU_X86_VARIANTS)
    case Isa::kAvx512: return avx512::RunConv(in, out_f32, p, par);
    case Isa::kAvx2: return avx2::RunConv(in, out_f32, p, par);
#endif
    default: return baseline::RunConv(in, out_f32, p, par);
  }
}

bool RunConvWgrad(DType in, bool out_f32, const ConvWgradParams& p, const Parallel& par) {
  switch (ChosenIsa()) {
#if defined(JBS_CPU_X86_VARIANTS)
    case Isa::kAvx512: return avx512::RunConvWgrad(in, out_f32, p, par);
    case Isa::kAvx2: return avx2::RunConvWgrad(in, out_f32, p, par);
#endif
    default: return baseline::RunConvWgrad(in, out_f32, p, par);
  }
}

const char* KernelIsa() {
  switch (ChosenIsa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace cpu
}  // namespace jbs
