// CPU kernels of the block-sparse convolution (implicit GEMM, no im2col): the problems
// the handlers (bsconv_cpu_handlers.cc) fill and the per-ISA kernels
// (bsconv_cpu_kernels.cc, compiled once per instruction set like bsmm_cpu_kernels.cc) run.
//
// One general convolution covers bsconv, its input gradient and bsconv_transpose (see
// jax_blocksparse/ops/conv_primitives.py). Per spatial dim, with the input a of `in`
// positions, the output of `out` positions and `kernel` taps:
//
//   out[o] = sum over taps t of  A(o * stride + t * rhs_dilation - pad_lo) @ M(t)
//   A(j)   = a[j / lhs_dilation] where lhs_dilation divides j and 0 <= j / lhs_dilation < in,
//            else 0 (the zeros of the input dilation and of the padding are never read)
//   M(t)   = W(t) [C, K], the block-sparse channel matrix of tap t, or with
//            transpose_kernel W(T - 1 - t)^T (the kernel flipped, channels swapped)
//
// (all spatial dims at once: t and o are multi-indices, T the number of taps). The weight
// gradient of that convolution is
//
//   dw[s][t] = sum over o of  A_t(o)[rows(s)]^T @ b[o][cols(s)]                 (plain)
//   dw[s][t] = sum over o of  b[o][rows(s)]^T @ A_{T-1-t}(o)[cols(s)]         (transpose_kernel)
//
// with A_t(o) = A(o * stride + t * rhs_dilation - pad_lo) and b the output gradient, at
// the layout's slots s only (zero at padding slots). Both accumulate in float32.
//
// The kernels read the input straight from NHWC: it is widened once per call into a
// block-major float32 copy with the zero border that the taps need along the innermost
// spatial dim (one copy of the input, never one per tap), and the taps become offsets
// into it. How: the outputs of one output line (fixed batch index and outer spatial
// coordinates) that share a phase o mod (lhs_dilation / gcd(stride, lhs_dilation)) read,
// for each tap, input positions in arithmetic progression; one register tile of such
// outputs sums over every (slot, tap) pair of its output block column.
#ifndef JAX_BLOCKSPARSE_CUDA_CPU_BSCONV_CPU_H_
#define JAX_BLOCKSPARSE_CUDA_CPU_BSCONV_CPU_H_

#include <cstdint>

#include "bsmm_problem.h"
#include "cpu/bsmm_cpu.h"

namespace jbs {
namespace cpu {

// Spatial dims the kernels take (1-D, 2-D, 3-D); more go through the bsmm composition.
constexpr int kMaxConvDims = 3;

struct ConvGeometry {
  int ndim;                            // spatial dims, 1..kMaxConvDims
  int64_t in[kMaxConvDims];            // input positions per dim (a, not dilated)
  int64_t out[kMaxConvDims];           // output positions per dim
  int64_t kernel[kMaxConvDims];        // taps per dim
  int64_t stride[kMaxConvDims];        // >= 1
  int64_t lhs_dilation[kMaxConvDims];  // >= 1
  int64_t rhs_dilation[kMaxConvDims];  // >= 1
  int64_t pad_lo[kMaxConvDims];        // any sign (negative crops)
};

// The convolution (forward, input gradient, transposed convolution).
struct ConvParams {
  const void* a;             // [n, *in, nin * bs]
  const void* w;             // [cap, *kernel, bs, bs] stored blocks of the [C, K] layout
  void* out;                 // [n, *out, nseg * bs], every element is written
  const int32_t* seg_ptr;    // [nseg + 1] entries of output block j: seg_ptr[j]:seg_ptr[j+1]
  const int32_t* seg_slots;  // [cap] entry -> slot; nullptr means slot == entry
  const int32_t* in_block;   // [cap] slot -> input block index (< nin)
  const int32_t* order;      // [nseg] output blocks, longest first (a permutation)
  const int32_t* nnz;        // scalar: slots >= *nnz are padding
  int64_t n;                 // batch
  int nin;                   // input channel blocks
  int nseg;                  // output channel blocks
  int cap;
  int bs;                 // one of kBlockSizes (bsmm_block_sizes.h)
  bool transpose_kernel;  // M(t) = W(T - 1 - t)^T: segments are layout rows, in_block = block_cols
  ConvGeometry g;
};

// The weight gradient of that convolution.
struct ConvWgradParams {
  const void* a;              // [n, *in, a_blocks * bs]: the convolution's input
  const void* b;              // [n, *out, b_blocks * bs]: the gradient of its output
  void* dw;                   // [cap, *kernel, bs, bs], every element is written (0 at padding)
  const int32_t* block_rows;  // [cap]
  const int32_t* block_cols;  // [cap]
  const int32_t* nnz;         // scalar
  int64_t n;
  int a_blocks;  // plain: C / bs (rows of the layout); transpose_kernel: K / bs
  int b_blocks;  // plain: K / bs; transpose_kernel: C / bs
  int cap;
  int bs;
  bool transpose_kernel;
  ConvGeometry g;
};

// Return false for an unsupported block size or when scratch memory cannot be had,
// having written nothing the caller may rely on.
bool RunConv(DType in, bool out_f32, const ConvParams& p, const Parallel& par);
bool RunConvWgrad(DType in, bool out_f32, const ConvWgradParams& p, const Parallel& par);

#define JBS_DECLARE_CONV_KERNELS(isa)                                                       \
  namespace isa {                                                                           \
  bool RunConv(DType in, bool out_f32, const ConvParams& p, const Parallel& par);           \
  bool RunConvWgrad(DType in, bool out_f32, const ConvWgradParams& p, const Parallel& par); \
  }

JBS_DECLARE_CONV_KERNELS(baseline)
JBS_DECLARE_CONV_KERNELS(avx2)
JBS_DECLARE_CONV_KERNELS(avx512)
#undef JBS_DECLARE_CONV_KERNELS

// The bfloat16 convolution and its weight gradient on AMX tiles (bsconv_cpu_bf16.cc,
// builds that define JBS_CPU_BF16_KERNELS): bfloat16 operands, blocks of bf16::kMinBlock or
// more (false, having written nothing, for smaller ones). The weight gradient only where
// WgradOnTiles(p): unit steps along the innermost spatial dim and an even number of
// outputs per line; other geometries run the widening kernels.
namespace bf16 {
bool RunConv(bool out_f32, const ConvParams& p, const Parallel& par);
bool WgradOnTiles(const ConvWgradParams& p);
bool RunConvWgrad(bool out_f32, const ConvWgradParams& p, const Parallel& par);
}  // namespace bf16

}  // namespace cpu
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_CPU_BSCONV_CPU_H_
