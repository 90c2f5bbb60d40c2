// Argument checks of the bsmm FFI handlers, shared by the CPU and CUDA handlers.
//
// Targets (operands in order; every table is int32 rank 1; see jax_blocksparse/layout.py):
//
//   jbs_bsmm_fprop(x [N..., C], w [cap, bs, bs], block_rows [cap], block_cols [cap],
//                  col_ptr [KB + 1], row_ptr [CB + 1], row_slots [cap], order [KB])
//       -> y [N..., K]
//   jbs_bsmm_bprop(g [N..., K], w [cap, bs, bs], <same five tables>, order [CB])
//       -> dx [N..., C]
//   jbs_bsmm_updat(x [N..., C], dy [N..., K], <same five tables>) -> dw [cap, bs, bs]
//
// `order` is the extra operand computed by the lowering (ops/_lowering.py): the output
// block columns (fprop) / rows (bprop) sorted longest first; workers visit them in that
// order. Inputs are float32, float16 or bfloat16 (both float operands alike); the output
// is the input dtype or float32. bs = w.shape[-1] (fprop, bprop) or dw.shape[-1] (updat).
//
// Shapes are checked here, not only in Python, because a custom call can be built by
// hand: any mismatch returns ffi::Error::InvalidArgument naming the target and the
// shapes. On success the checks fill the problem a kernel runs (bsmm_problem.h) with the
// buffers' data pointers; they never read the buffers, so they are safe for device memory.
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_CHECKS_H_
#define JAX_BLOCKSPARSE_CUDA_BSMM_CHECKS_H_

#include <cstdint>
#include <string>

#include "bsmm_block_sizes.h"  // SupportedBlockSize, kBlockSizesText
#include "bsmm_problem.h"
#include "xla/ffi/api/ffi.h"

namespace jbs {

// "[d0, d1, ...]" of a buffer, for error messages.
std::string ShapeStr(const xla::ffi::AnyBuffer& b);

// The three float operands of a call, for error messages: formatted (str()) only when
// an error is reported, so a successful call builds no string.
struct Operands {
  const char* names[3];
  const xla::ffi::AnyBuffer* buffers[3];
  std::string str() const;  // e.g. "lhs [7, 48], w [6, 16, 16], out [7, 80]"
};
Operands DescribeDsd(const xla::ffi::AnyBuffer& lhs, const xla::ffi::AnyBuffer& w, const xla::ffi::AnyBuffer& out);
Operands DescribeSdd(const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& dy, const xla::ffi::AnyBuffer& dw);

// The dtypes a kernel runs with.
struct KernelDtypes {
  DType in;      // both float inputs
  bool out_f32;  // float32 output (else the input dtype)
};

// Pieces of the checks that other targets' checks share (cpu/bsconv_cpu_handlers.cc).

// "float32", "bfloat16", ... for error messages.
const char* DtypeName(xla::ffi::DataType t);

// InvalidArgument "<op>: <what>".
xla::ffi::Error Invalid(const char* op, const std::string& what);

// The five layout tables, checked against each other (rank-1 int32, [capacity] where
// they must be); their data pointers.
struct Tables {
  const int32_t* block_rows;
  const int32_t* block_cols;
  const int32_t* col_ptr;
  const int32_t* row_ptr;
  const int32_t* row_slots;
  int64_t cap, cb, kb;
};
xla::ffi::Error CheckTables(const char* op, const xla::ffi::AnyBuffer& block_rows,
                            const xla::ffi::AnyBuffer& block_cols, const xla::ffi::AnyBuffer& col_ptr,
                            const xla::ffi::AnyBuffer& row_ptr, const xla::ffi::AnyBuffer& row_slots, Tables* t);

// Both float inputs share one supported dtype; the output is that dtype or float32.
xla::ffi::Error CheckDtypes(const char* op, const xla::ffi::AnyBuffer& a, const xla::ffi::AnyBuffer& b,
                            const xla::ffi::AnyBuffer& out, KernelDtypes* dtypes);

// "a layout grid (CB, KB) of block bs", for error messages.
std::string GridStr(const Tables& t, int64_t bs);

// fprop (transpose = false: lhs = x, out = y) and bprop (transpose = true: lhs = g, out = dx).
xla::ffi::Error CheckDsd(const char* op, bool transpose, const xla::ffi::AnyBuffer& lhs, const xla::ffi::AnyBuffer& w,
                         const xla::ffi::AnyBuffer& block_rows, const xla::ffi::AnyBuffer& block_cols,
                         const xla::ffi::AnyBuffer& col_ptr, const xla::ffi::AnyBuffer& row_ptr,
                         const xla::ffi::AnyBuffer& row_slots, const xla::ffi::AnyBuffer& order,
                         xla::ffi::AnyBuffer& out, KernelDtypes* dtypes, DsdParams* p);

// The work list the Hopper v2 fprop/bprop targets take after `order` (after CheckDsd
// filled `p`): work int32 [2 * cap] (pairs input block, slot), work_ptr int32 [nseg + 1];
// sets p->work and p->work_ptr.
xla::ffi::Error CheckWorkList(const char* op, const xla::ffi::AnyBuffer& work, const xla::ffi::AnyBuffer& work_ptr,
                              DsdParams* p);

// updat.
xla::ffi::Error CheckSdd(const char* op, const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& dy,
                         const xla::ffi::AnyBuffer& block_rows, const xla::ffi::AnyBuffer& block_cols,
                         const xla::ffi::AnyBuffer& col_ptr, const xla::ffi::AnyBuffer& row_ptr,
                         const xla::ffi::AnyBuffer& row_slots, xla::ffi::AnyBuffer& dw, KernelDtypes* dtypes,
                         SddParams* p);

// The operands of the targets, bound in the order documented above, after the
// platform's context (CUDA: the stream; CPU: XLA's thread pool).
template <typename Ctx>
auto BindDsd() {  // fprop and bprop
  using xla::ffi::AnyBuffer;
  return xla::ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<AnyBuffer>()   // lhs: x [N..., C] (fprop) or g [N..., K] (bprop)
      .template Arg<AnyBuffer>()   // w [cap, bs, bs]
      .template Arg<AnyBuffer>()   // block_rows [cap]
      .template Arg<AnyBuffer>()   // block_cols [cap]
      .template Arg<AnyBuffer>()   // col_ptr [KB + 1]
      .template Arg<AnyBuffer>()   // row_ptr [CB + 1]
      .template Arg<AnyBuffer>()   // row_slots [cap]
      .template Arg<AnyBuffer>()   // order [KB] (fprop) or [CB] (bprop), longest first
      .template Ret<AnyBuffer>();  // y [N..., K] (fprop) or dx [N..., C] (bprop)
}

template <typename Ctx>
auto BindSdd() {  // updat
  using xla::ffi::AnyBuffer;
  return xla::ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<AnyBuffer>()   // x [N..., C]
      .template Arg<AnyBuffer>()   // dy [N..., K]
      .template Arg<AnyBuffer>()   // block_rows [cap]
      .template Arg<AnyBuffer>()   // block_cols [cap]
      .template Arg<AnyBuffer>()   // col_ptr [KB + 1]
      .template Arg<AnyBuffer>()   // row_ptr [CB + 1] (unused)
      .template Arg<AnyBuffer>()   // row_slots [cap] (unused)
      .template Ret<AnyBuffer>();  // dw [cap, bs, bs]
}

// Whether a checked problem has no output element (nothing to launch).
inline bool IsEmpty(const DsdParams& p) { return p.n == 0 || p.nseg == 0; }
inline bool IsEmpty(const SddParams& p) { return p.cap == 0; }

}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_BSMM_CHECKS_H_
