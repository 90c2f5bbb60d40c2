// XLA FFI handlers of the bsmm custom calls on CPU: the shared checks, then the kernels
// on XLA's intra-op thread pool (cpu_parallel.h).
//
// Same targets, operands and checks as on CUDA (bsmm_checks.h). The handlers are
// synchronous: they return when every work item has run.
#include <algorithm>
#include <cstdint>
#include <string>

#include "bsmm_checks.h"
#include "cpu/bsmm_cpu.h"
#include "cpu/cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbs {
namespace {

// Multiply-adds of a checked problem: rows x blocks present x bs^2 (the tables are in
// host memory on CPU, so the block count can be read here).
int64_t Macs(int64_t rows, const int32_t* nnz, int cap, int bs) {
  const int64_t blocks = std::min<int64_t>(std::max<int32_t>(*nnz, 0), cap);
  return rows * blocks * bs * bs;
}

ffi::Error Unsupported(const char* op, const Operands& shapes) {
  return ffi::Error::Internal(
      std::string(op) + ": no CPU kernel for this block size, or no memory for its scratch buffers; " + shapes.str());
}

ffi::Error DsdImpl(const char* op, bool transpose, ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer w,
                   ffi::AnyBuffer block_rows, ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                   ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> out) {
  KernelDtypes dt;
  DsdParams p;
  if (ffi::Error e =
          CheckDsd(op, transpose, a, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, order, *out, &dt, &p);
      e.failure()) {
    return e;
  }
  if (IsEmpty(p)) return ffi::Error::Success();
  if (const char* isa_error = cpu::IsaOverrideError()) return ffi::Error::InvalidArgument(isa_error);
  cpu::AdviseHugePages(out->untyped_data(), static_cast<int64_t>(out->size_bytes()));
  if (!cpu::RunDsd(dt.in, dt.out_f32, transpose, p, cpu::Workers(pool, Macs(p.n, p.nnz, p.cap, p.bs)))) {
    return Unsupported(op, DescribeDsd(a, w, *out));
  }
  return ffi::Error::Success();
}

ffi::Error FpropImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> y) {
  return DsdImpl("jbs_bsmm_fprop", false, pool, x, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, order, y);
}

ffi::Error BpropImpl(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> dx) {
  return DsdImpl("jbs_bsmm_bprop", true, pool, g, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, order, dx);
}

ffi::Error UpdatImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::Result<ffi::AnyBuffer> dw) {
  const char* op = "jbs_bsmm_updat";
  KernelDtypes dt;
  SddParams p;
  if (ffi::Error e = CheckSdd(op, x, dy, block_rows, block_cols, col_ptr, row_ptr, row_slots, *dw, &dt, &p);
      e.failure()) {
    return e;
  }
  if (IsEmpty(p)) return ffi::Error::Success();
  if (const char* isa_error = cpu::IsaOverrideError()) return ffi::Error::InvalidArgument(isa_error);
  cpu::AdviseHugePages(dw->untyped_data(), static_cast<int64_t>(dw->size_bytes()));
  if (!cpu::RunSdd(dt.in, dt.out_f32, p, cpu::Workers(pool, Macs(p.n, p.nnz, p.cap, p.bs)))) {
    return Unsupported(op, DescribeSdd(x, dy, *dw));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jbs

// Bindings: the shared operand lists (bsmm_checks.h) after XLA's intra-op thread pool.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmFpropCpu, jbs::FpropImpl, jbs::BindDsd<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmBpropCpu, jbs::BpropImpl, jbs::BindDsd<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmUpdatCpu, jbs::UpdatImpl, jbs::BindSdd<ffi::ThreadPool>());
