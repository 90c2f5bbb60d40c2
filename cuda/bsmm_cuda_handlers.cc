// XLA FFI handlers of the bsmm custom calls on CUDA: checks, stream device, launches.
//
// The operands and their checks are shared with the CPU handlers (bsmm_checks.h). The
// handlers never allocate, synchronise or read device memory on the host, so they are
// CUDA-graph (command buffer) compatible.
#include <string>

#include <cuda_runtime_api.h>

#include "bsmm_checks.h"
#include "bsmm_cuda_info.h"
#include "bsmm_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbs {

int CudaRuntimeVersionBuiltAgainst() { return CUDART_VERSION; }

int CudaRuntimeVersionLinked() {
  int runtime = 0;  // the statically linked runtime; works without a driver
  return cudaRuntimeGetVersion(&runtime) == cudaSuccess ? runtime : -1;
}

namespace {

// Makes the stream's device current, so that per-device calls (cudaFuncSetAttribute)
// and launches address the device XLA runs this op on.
ffi::Error UseStreamDevice(const char* op, cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  int device = -1;
  cudaError_t err = cudaStreamGetDevice(stream, &device);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(op) + ": cannot select the stream's device: " +
                                cudaGetErrorString(err));
  }
#else
  (void)op;
  (void)stream;  // XLA has made the device current on this thread
#endif
  return ffi::Error::Success();
}

ffi::Error LaunchError(const char* op, cudaError_t err, const std::string& shapes) {
  return ffi::Error::Internal(std::string(op) + ": kernel launch failed (" + cudaGetErrorString(err) +
                              ") for " + shapes);
}

// fprop (transpose = false) and bprop (transpose = true).
ffi::Error DsdImpl(const char* op, bool transpose, cudaStream_t stream, ffi::AnyBuffer a,
                   ffi::AnyBuffer w, ffi::AnyBuffer block_rows, ffi::AnyBuffer block_cols,
                   ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr, ffi::AnyBuffer row_slots,
                   ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> out) {
  KernelDtypes dt;
  DsdParams p;
  std::string shapes;
  if (ffi::Error e = CheckDsd(op, transpose, a, w, block_rows, block_cols, col_ptr, row_ptr, row_slots,
                              order, *out, &dt, &p, &shapes);
      e.failure()) {
    return e;
  }
  if (IsEmpty(p)) return ffi::Error::Success();
  if (ffi::Error e = UseStreamDevice(op, stream); e.failure()) return e;
  cudaError_t err = LaunchDsd(dt.in, dt.out_f32, transpose, p, stream);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return LaunchError(op, err, shapes);
  return ffi::Error::Success();
}

ffi::Error FpropImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> y) {
  return DsdImpl("jbs_bsmm_fprop", false, stream, x, w, block_rows, block_cols, col_ptr, row_ptr,
                 row_slots, order, y);
}

ffi::Error BpropImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> dx) {
  return DsdImpl("jbs_bsmm_bprop", true, stream, g, w, block_rows, block_cols, col_ptr, row_ptr,
                 row_slots, order, dx);
}

ffi::Error UpdatImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::Result<ffi::AnyBuffer> dw) {
  const char* op = "jbs_bsmm_updat";
  KernelDtypes dt;
  SddParams p;
  std::string shapes;
  if (ffi::Error e = CheckSdd(op, x, dy, block_rows, block_cols, col_ptr, row_ptr, row_slots, *dw, &dt, &p,
                              &shapes);
      e.failure()) {
    return e;
  }
  if (IsEmpty(p)) return ffi::Error::Success();
  if (ffi::Error e = UseStreamDevice(op, stream); e.failure()) return e;
  cudaError_t err = LaunchSdd(dt.in, dt.out_f32, p, stream);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return LaunchError(op, err, shapes);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jbs

// Bindings: the shared operand lists (bsmm_checks.h) after XLA's compute stream.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmFpropCuda, jbs::FpropImpl, jbs::BindDsd<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmBpropCuda, jbs::BpropImpl, jbs::BindDsd<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmUpdatCuda, jbs::UpdatImpl, jbs::BindSdd<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});
