// Where the Hopper targets run float32 on TF32 tensor cores: the block sizes per product,
// and why not at the others. No CUDA headers: the launchers (bsmm_sm90_dispatch.cu), the
// FFI handlers and the pybind11 module (module.cc, host compiler only, in every build:
// build_info()["sm90"]["tf32_block_sizes"] and ["tf32_off"], which
// jax_blocksparse/ops/_sm90.py reads) all include it.
//
// DSD (fprop, bprop) at block 8 is off: its TF32 kernel,
// DsdPackedSm90Kernel<DsdPackedConfig<tfloat32_t, float, 8, true>>, faulted on an H100
// ("misaligned shared or local address" at its second TMA load of a w block: the 8 x 8
// float32 block was issued as four unswizzled 2-row boxes 64 bytes apart). The box is fixed
// and checked at compile time (bsmm_sm90_dsd_packed.cuh, CheckTmaBox), but no GPU has run
// the fixed kernel yet; until one does, float32 at block 8 runs the exact kernels. The
// FFI targets refuse tf32=true there (the lowering never asks for it).
//
// JBS_SM90_TF32_DSD_BLOCK8 (CMake option of that name, build.py --sm90-tf32-block8)
// switches it on, so that a GPU check can build, test and time it before it is on for
// everyone; build_info()["sm90"]["tf32_dsd_block8_switch"] says whether a build has it.
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_TF32_H_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_TF32_H_

#include "bsmm_block_sizes.h"

namespace jbs {
namespace sm90 {

// DSD (fprop, bprop: bsmm_sm90_dsd_packed.cuh below 64, bsmm_sm90_dsd.cuh at 64/128).
#if defined(JBS_SM90_TF32_DSD_BLOCK8) && JBS_SM90_TF32_DSD_BLOCK8
constexpr bool kDsdTF32Block8Switch = true;
constexpr int kDsdTF32BlockSizes[] = {8, 16, 32, 64, 128};
#else
constexpr bool kDsdTF32Block8Switch = false;
constexpr int kDsdTF32BlockSizes[] = {16, 32, 64, 128};
#endif
// SDD (updat: bsmm_sm90_sdd_small.cuh below 64, bsmm_sm90_sdd.cuh at 64/128).
constexpr int kSddTF32BlockSizes[] = {8, 16, 32, 64, 128};

template <int N>
constexpr bool BlockSizeIn(const int (&sizes)[N], int bs) {
  for (int s : sizes) {
    if (s == bs) return true;
  }
  return false;
}
constexpr bool DsdTF32Block(int bs) { return BlockSizeIn(kDsdTF32BlockSizes, bs); }
constexpr bool SddTF32Block(int bs) { return BlockSizeIn(kSddTF32BlockSizes, bs); }

// Why TF32 is off at the supported block sizes a table leaves out ("" where none is).
#if defined(JBS_SM90_TF32_DSD_BLOCK8) && JBS_SM90_TF32_DSD_BLOCK8
constexpr char kDsdTF32Off[] = "";
#else
constexpr char kDsdTF32Off[] =
    "its TF32 kernel faulted on an H100 (misaligned shared address: each 8 x 8 float32 w block went out as four "
    "unswizzled TMA boxes 64 bytes apart); fixed and checked at compile time, not yet run on a GPU";
#endif
constexpr char kSddTF32Off[] = "";

template <int N>
constexpr bool OnlySupportedSizes(const int (&sizes)[N]) {
  for (int s : sizes) {
    if (!SupportedBlockSize(s)) return false;
  }
  return true;
}
template <int N>
constexpr bool EverySupportedSize(const int (&sizes)[N]) {
  for (int s : kBlockSizes) {
    if (!BlockSizeIn(sizes, s)) return false;
  }
  return true;
}
static_assert(OnlySupportedSizes(kDsdTF32BlockSizes) && OnlySupportedSizes(kSddTF32BlockSizes),
              "a TF32 block size without kernels (bsmm_block_sizes.h)");
static_assert(EverySupportedSize(kDsdTF32BlockSizes) || kDsdTF32Off[0] != '\0', "say in kDsdTF32Off why TF32 is off");
static_assert(EverySupportedSize(kSddTF32BlockSizes) || kSddTF32Off[0] != '\0', "say in kSddTF32Off why TF32 is off");

}  // namespace sm90
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_TF32_H_
