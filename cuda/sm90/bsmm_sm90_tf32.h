// Where the Hopper targets run float32 on TF32 tensor cores: the block sizes per product,
// and why not at the others. No CUDA headers: the launchers (bsmm_sm90_dispatch.cu), the
// FFI handlers and the pybind11 module (module.cc, host compiler only, in every build:
// build_info()["sm90"]["tf32_block_sizes"] and ["tf32_off"], which
// jax_blocksparse/ops/_sm90.py reads) all include it.
//
// TF32 is on for every product at every block size. DSD at block 8
// (DsdPackedSm90Kernel<DsdPackedConfig<tfloat32_t, float, 8, true>>) once faulted on an
// H100 ("misaligned shared or local address": each 8 x 8 float32 w block went out as four
// unswizzled 2-row TMA boxes 64 bytes apart); the box is fixed and checked at compile time
// (bsmm_sm90_dsd_packed.cuh, CheckTmaBox), and the fixed kernel ran clean on an H100 on
// 2026-11-26 (its isolated tests, memcheck and racecheck). A size left out of a table
// below runs the exact float32 kernels, with its reason in k*TF32Off, and the FFI targets
// refuse tf32=true there (the lowering never asks for it).
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_TF32_H_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_TF32_H_

#include "bsmm_block_sizes.h"

namespace jbs {
namespace sm90 {

// DSD (fprop, bprop: bsmm_sm90_dsd_packed.cuh below 64, bsmm_sm90_dsd.cuh at 64/128).
constexpr int kDsdTF32BlockSizes[] = {8, 16, 32, 64, 128};
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
constexpr char kDsdTF32Off[] = "";
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
