// Picks the instruction set the CPU kernels run: the widest the running CPU supports, or a
// lower one named by JAX_BLOCKSPARSE_CPU_ISA.
//
// The build compiles the kernel files (bsmm_cpu_kernels.cc, bsconv_cpu_kernels.cc) for
// "baseline" everywhere and, on x86-64 (where it defines JBS_CPU_X86_VARIANTS), also for
// "avx2" (AVX2 + FMA) and "avx512" (AVX-512F). Where the compiler has the AMX and
// AVX512-BF16 flags it also builds bsmm_cpu_bf16.cc and bsconv_cpu_bf16.cc
// (JBS_CPU_BF16_KERNELS): bfloat16 products run there on "amx" (tiles) or "avx512_bf16"
// (dot products) machines, the bfloat16 convolution and (for unit-step geometries) its
// weight gradient on "amx" only; every other dtype, and the convolutions that have no
// tile form there, run the "avx512" kernels on those machines.
#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu/bsconv_cpu.h"
#include "cpu/bsmm_cpu.h"
#include "cpu/cpu_parallel.h"

#if defined(JBS_CPU_X86_VARIANTS) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define JBS_CPU_DETECT_X86 1
#endif

namespace jbs {
namespace cpu {
namespace {

// Ordered: a forced instruction set must not be above the detected one.
enum class Isa { kBaseline, kAvx2, kAvx512, kAvx512Bf16, kAmx };
constexpr const char* kIsaNames[] = {"baseline", "avx2", "avx512", "avx512_bf16", "amx"};
constexpr int kIsaCount = 5;

const char* Name(Isa isa) { return kIsaNames[static_cast<int>(isa)]; }

#if defined(JBS_CPU_DETECT_X86)
bool CpuidBit(unsigned leaf, unsigned subleaf, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(leaf, subleaf, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}

// Linux hands out the AMX tile data (XTILEDATA, state component 18) only on request.
bool RequestAmxPermission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

Isa Detect() {
#if defined(JBS_CPU_DETECT_X86)
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  if (__builtin_cpu_supports("avx512f")) {
#if defined(JBS_CPU_BF16_KERNELS)
    constexpr int kEax = 0, kEdx = 3;
    const bool bw_vl = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    const bool bf16 = bw_vl && CpuidBit(7, 1, kEax, 5);                             // AVX512_BF16
    const bool amx = bf16 && CpuidBit(7, 0, kEdx, 24) && CpuidBit(7, 0, kEdx, 22);  // AMX-TILE, AMX-BF16
    if (amx && RequestAmxPermission()) return Isa::kAmx;
    if (bf16) return Isa::kAvx512Bf16;
#endif
    return Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

Isa Detected() {
  static const Isa isa = Detect();
  return isa;
}

// JAX_BLOCKSPARSE_CPU_ISA, read at every call: unset or empty -> the detected set; a name
// at or below it -> that set; else *error says why and the detected set is returned.
Isa Chosen(std::string* error = nullptr) {
  const char* forced = std::getenv("JAX_BLOCKSPARSE_CPU_ISA");
  if (forced == nullptr || forced[0] == '\0') return Detected();
  for (int i = 0; i < kIsaCount; ++i) {
    if (std::strcmp(forced, kIsaNames[i]) != 0) continue;
    if (i <= static_cast<int>(Detected())) return static_cast<Isa>(i);
    if (error) {
      *error = std::string("JAX_BLOCKSPARSE_CPU_ISA=") + forced + ": this CPU (or this build) supports at most '" +
               Name(Detected()) + "'";
    }
    return Detected();
  }
  if (error) {
    std::string names;  // widest first
    for (int i = kIsaCount - 1; i >= 0; --i) names += std::string(kIsaNames[i]) + (i > 0 ? ", " : "");
    *error = std::string("JAX_BLOCKSPARSE_CPU_ISA=") + forced + ": expected one of " + names + " (at most '" +
             Name(Detected()) + "' on this CPU), or unset";
  }
  return Detected();
}

#if defined(JBS_CPU_BF16_KERNELS)
// Whether a product runs on the matrix units (bfloat16, blocks of bf16::kMinBlock or more,
// an "avx512_bf16" or "amx" set in force), and on which engine.
bool OnMatrixUnits(Isa isa, DType in, int bs, bf16::Engine* engine) {
  if (in != DType::kBF16 || isa < Isa::kAvx512Bf16 || bs < bf16::kMinBlock) return false;
  *engine = isa == Isa::kAmx ? bf16::Engine::kAmx : bf16::Engine::kDot;
  return true;
}

// The workers of a product on `engine`: on the tiles, fewer (cpu::OnTiles).
Parallel EngineWorkers(bf16::Engine engine, const Parallel& par) {
  return engine == bf16::Engine::kAmx ? OnTiles(par) : par;
}
#endif

}  // namespace

bool RunDsd(DType in, bool out_f32, bool transpose_w, const DsdParams& p, const Parallel& par) {
  const Isa isa = Chosen();
#if defined(JBS_CPU_BF16_KERNELS)
  bf16::Engine engine;
  if (OnMatrixUnits(isa, in, p.bs, &engine)) {
    return bf16::RunDsd(engine, out_f32, transpose_w, p, EngineWorkers(engine, par));
  }
#endif
  switch (isa) {
#if defined(JBS_CPU_X86_VARIANTS)
    case Isa::kAmx:
    case Isa::kAvx512Bf16:
    case Isa::kAvx512: return avx512::RunDsd(in, out_f32, transpose_w, p, par);
    case Isa::kAvx2: return avx2::RunDsd(in, out_f32, transpose_w, p, par);
#endif
    default: return baseline::RunDsd(in, out_f32, transpose_w, p, par);
  }
}

bool RunSdd(DType in, bool out_f32, const SddParams& p, const Parallel& par) {
  const Isa isa = Chosen();
#if defined(JBS_CPU_BF16_KERNELS)
  bf16::Engine engine;
  if (OnMatrixUnits(isa, in, p.bs, &engine)) {
    return bf16::RunSdd(engine, out_f32, p, EngineWorkers(engine, par));
  }
#endif
  switch (isa) {
#if defined(JBS_CPU_X86_VARIANTS)
    case Isa::kAmx:
    case Isa::kAvx512Bf16:
    case Isa::kAvx512: return avx512::RunSdd(in, out_f32, p, par);
    case Isa::kAvx2: return avx2::RunSdd(in, out_f32, p, par);
#endif
    default: return baseline::RunSdd(in, out_f32, p, par);
  }
}

bool RunConv(DType in, bool out_f32, const ConvParams& p, const Parallel& par) {
  const Isa isa = Chosen();
#if defined(JBS_CPU_BF16_KERNELS)
  // Tiles only: the convolution has no dot-engine form, "avx512_bf16" widens.
  bf16::Engine engine;
  if (OnMatrixUnits(isa, in, p.bs, &engine) && engine == bf16::Engine::kAmx) return bf16::RunConv(out_f32, p, par);
#endif
  switch (isa) {
#if defined(JBS_CPU_X86_VARIANTS)
    case Isa::kAmx:
    case Isa::kAvx512Bf16:
    case Isa::kAvx512: return avx512::RunConv(in, out_f32, p, par);
    case Isa::kAvx2: return avx2::RunConv(in, out_f32, p, par);
#endif
    default: return baseline::RunConv(in, out_f32, p, par);
  }
}

bool RunConvWgrad(DType in, bool out_f32, const ConvWgradParams& p, const Parallel& par) {
  const Isa isa = Chosen();
#if defined(JBS_CPU_BF16_KERNELS)
  bf16::Engine engine;
  if (OnMatrixUnits(isa, in, p.bs, &engine) && engine == bf16::Engine::kAmx && bf16::WgradOnTiles(p)) {
    return bf16::RunConvWgrad(out_f32, p, par);
  }
#endif
  switch (isa) {
#if defined(JBS_CPU_X86_VARIANTS)
    case Isa::kAmx:
    case Isa::kAvx512Bf16:
    case Isa::kAvx512: return avx512::RunConvWgrad(in, out_f32, p, par);
    case Isa::kAvx2: return avx2::RunConvWgrad(in, out_f32, p, par);
#endif
    default: return baseline::RunConvWgrad(in, out_f32, p, par);
  }
}

double AmxPeakProbe(int64_t steps) {
#if defined(JBS_CPU_BF16_KERNELS)
  if (Detected() == Isa::kAmx) return bf16::TilePeakFlops(steps);
#endif
  (void)steps;
  return -1.0;
}

const char* KernelIsa() { return Name(Chosen()); }

const char* DetectedIsa() { return Name(Detected()); }

int IsaCount() { return kIsaCount; }

const char* IsaName(int i) { return i >= 0 && i < kIsaCount ? kIsaNames[i] : ""; }

const char* IsaOverrideError() {
  static thread_local std::string error;
  error.clear();
  Chosen(&error);
  return error.empty() ? nullptr : error.c_str();
}

}  // namespace cpu
}  // namespace jbs
