// Pieces shared by the sm_90a kernels: CuTe/CUTLASS headers, warp roles, the
// shared-memory limit setup. Compiled for sm_90a only (build.py: cuda/sm90/*.cu).
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_COMMON_CUH_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_COMMON_CUH_

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "bsmm_problem.h"
#include "bsmm_work_plan.h"
#include "sm90/bsmm_sm90.h"

namespace jbs {
namespace sm90 {
namespace detail {

// CUTLASS's element types for the library's dtypes (same bits as __half / __nv_bfloat16).
template <DType D>
struct Element;
template <>
struct Element<DType::kF16> {
  using type = cutlass::half_t;
};
template <>
struct Element<DType::kBF16> {
  using type = cutlass::bfloat16_t;
};

// Warp roles of every kernel: warpgroup 0 produces (one elected thread issues the TMA
// loads; the other warps idle with few registers), warpgroups 1.. consume (GMMA and
// epilogue). 128 threads per warpgroup.
constexpr int kWarpgroupThreads = 128;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
// Named barrier among the consumer threads (ids 0.. are reserved by CUTLASS).
constexpr int kEpilogueBarrier = 1;

// The GMMA smem atom whose swizzle row is `Width` elements of T (16, 32, 64, 128 bytes):
// the packed small-block kernels (bsmm_sm90_dsd_packed.cuh, bsmm_sm90_sdd_small.cuh).
template <typename T, cute::GMMA::Major M, int Width>
using AtomFor = cute::conditional_t<
    Width * sizeof(T) == 16, cute::GMMA::Layout_INTER_Atom<T, M>,
    cute::conditional_t<Width * sizeof(T) == 32, cute::GMMA::Layout_SW32_Atom<T, M>,
                        cute::conditional_t<Width * sizeof(T) == 64, cute::GMMA::Layout_SW64_Atom<T, M>,
                                            cute::GMMA::Layout_SW128_Atom<T, M>>>>;

// Bytes after which a swizzle's pattern repeats: Swizzle<B, M, S> acts on byte addresses
// (the smem_ptr_flag convention of the GMMA atoms), XOR-ing bits [M + S, M + S + B) into
// [M, M + B): 128 unswizzled (INTER), 256 / 512 / 1024 for SW32 / SW64 / SW128.
template <class Swizzle>
constexpr int kSwizzleRepeatBytes =
    1 << (Swizzle::num_bits + Swizzle::num_base + (Swizzle::num_shft < 0 ? -Swizzle::num_shft : Swizzle::num_shft));

// Compile-time checks of one TMA copy (`Tma`, built by make_tma_copy from the shared-memory
// box layout `Box` of elements T) against the GMMA atom `Atom` the box is tiled from; every
// config asserts them for each of its TMA copies (CheckTmaBox<...>() in a static_assert).
// * The box keeps the atom's swizzle, so the descriptor's swizzle mode is the one the GMMA
//   descriptors read. CuTe's slice of a swizzled layout (slice_and_offset,
//   cute/swizzle_layout.hpp) tests the swizzle's bits against element offsets although the
//   swizzle acts on byte addresses: a slice whose offsets do not reach those bits decays to a
//   plain layout, and make_tma_copy then builds an unswizzled, split box. (That happened to
//   the 8 x 8 float32 B block of DsdPackedConfig, see there; the boxes are now built from
//   unsliced atom tilings.)
// * Each TMA instruction of the box (the box is issued as Tiler / AtomNumVal instructions,
//   in order of shared-memory offset, see tma_partition) and each box of a buffer (box q at
//   q * box bytes) starts at a multiple of the swizzle's repeat: at least 128 bytes, the TMA
//   unit's alignment rule for shared-memory addresses ("misaligned shared address"
//   otherwise), and the repeat, so that TMA and GMMA, which both swizzle on address bits,
//   see the same pattern. The buffers themselves start at multiples of 1024 bytes
//   (array_aligned<.., 1024> in each SharedStorage, asserted there).
// * The box is compact (its offsets fill [0, size)), which the two rules above assume.
template <typename T, class Tma, class Box, class Atom>
constexpr bool CheckTmaBox() {
  using SwizzleBox = decltype(cute::get_swizzle_portion(Box{}));
  using SwizzleAtom = decltype(cute::get_swizzle_portion(Atom{}));
  static_assert(cute::is_same_v<SwizzleBox, SwizzleAtom>,
                "TMA box: the box layout lost the swizzle of its GMMA atom (a decayed slice?)");
  using BoxLayout = decltype(cute::get_nonswizzle_portion(Box{}));
  static_assert(cute::is_static<BoxLayout>::value, "TMA box: not a static layout");
  constexpr int kBoxElems = decltype(cute::size(BoxLayout{}))::value;
  if constexpr (cute::is_static<BoxLayout>::value) {
    static_assert(decltype(cute::cosize(BoxLayout{}))::value == kBoxElems, "TMA box: not a compact layout");
  }
  constexpr int kRepeat = kSwizzleRepeatBytes<SwizzleAtom>;
  constexpr int kInstrBytes =
      static_cast<int>(decltype(cute::size<1>(typename Tma::AtomLayoutRef{}))::value * sizeof(T));
  constexpr int kBoxBytes = static_cast<int>(kBoxElems * sizeof(T));
  static_assert(decltype(cute::size(typename Tma::Tiler_MN{}))::value == kBoxElems,
                "TMA box: the copy moves another tile");
  static_assert(kInstrBytes % kRepeat == 0,
                "TMA box: an instruction of the box starts off the 128-byte / swizzle-repeat alignment");
  static_assert(kBoxBytes % kRepeat == 0,
                "TMA box: consecutive boxes start off the 128-byte / swizzle-repeat alignment");
  return true;
}

__device__ __forceinline__ int Clamp(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Loads `kernel`'s module and sets its dynamic shared memory limit; capture-unsafe.
// Only PrepareKernelsSm90() reaches it, through the launchers' prepare_only path.
template <typename Kernel>
inline cudaError_t LoadWithSharedLimit(Kernel kernel, int bytes) {
  // capture-unsafe: begin
  cudaFuncAttributes attributes;
  cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);
  if (err != cudaSuccess) return err;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  // capture-unsafe: end
}
template <typename Kernel>
inline cudaError_t PrepareKernel(Kernel kernel, int bytes) {
  return LoadWithSharedLimit(kernel, bytes);
}
// A kernel with its second-pass kernel (no dynamic shared memory): both prepared.
template <typename Kernel, typename Second>
inline cudaError_t PrepareKernel(Kernel kernel, int bytes, Second second) {
  cudaError_t err = LoadWithSharedLimit(kernel, bytes);
  return err != cudaSuccess ? err : LoadWithSharedLimit(second, 0);
}

// Slot and input block of layout entry `entry`, or false when it contributes nothing
// (a padding slot or an out-of-range input block: the same rule as the Ampere kernels).
__device__ __forceinline__ bool DsdEntrySource(const DsdParams& p, int nnz, int entry, int* slot, int* in_block) {
  const int s = p.seg_slots != nullptr ? __ldg(p.seg_slots + entry) : entry;
  if (s < 0 || s >= nnz) return false;
  const int ib = __ldg(p.in_block + s);
  if (ib < 0 || ib >= p.nin) return false;
  *slot = s;
  *in_block = ib;
  return true;
}

// Copies a consumer warpgroup's accumulators into the shared epilogue tile, converted
// to the output type. tCsC: thr_mma.partition_C of the tile, same shape as `accum`.
template <class Accum, class SmemPart>
__device__ __forceinline__ void StoreAccum(const Accum& accum, SmemPart&& tCsC) {
  using OutT = typename cute::remove_cvref_t<SmemPart>::value_type;
  CUTE_UNROLL
  for (int i = 0; i < cute::size(accum); ++i) tCsC(i) = static_cast<OutT>(accum(i));
}

}  // namespace detail
}  // namespace sm90
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_COMMON_CUH_
