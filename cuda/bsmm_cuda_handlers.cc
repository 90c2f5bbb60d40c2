// XLA FFI handlers of the bsmm custom calls on CUDA: checks, kernel preparation, launches.
//
// The operands and their checks are shared with the CPU handlers (bsmm_checks.h).
//
// CUDA graphs (XLA's command buffers): XLA records larger programs by stream capture,
// and calls the execute stage of a command-buffer-compatible handler while capturing.
// During capture, per-device setup (module loading, cudaFuncSetAttribute, cudaSetDevice)
// is illegal. So each target has two stages:
//   initialize  (never captured; XLA runs it before executing or recording the program)
//               prepares every kernel on the stream's device, once per device;
//   execute     checks the operands, then makes only capture-safe calls: cudaGetDevice,
//               cudaStreamIsCapturing (when the device is not prepared yet), the kernel
//               launch and cudaGetLastError. It never allocates, synchronises or reads
//               device memory on the host.
// The per-device preparation is shared with the Hopper handlers (bsmm_cuda_device.h).
// tests/test_cuda_graph_safety.py checks that the capture-unsafe calls stay inside the
// regions marked "capture-unsafe" (bsmm_cuda_device.cc, bsmm_common.cuh).
#include <string>

#include <cuda_runtime_api.h>

#include "bsmm_checks.h"
#include "bsmm_cuda_device.h"
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

// The devices whose Ampere-design kernels are prepared (bsmm_cuda_device.h): every
// device these kernels run on.
PreparedDevices& Devices() {
  static PreparedDevices devices(&PrepareKernels, nullptr);
  return devices;
}

ffi::Error RequirePrepared(const char* op, cudaStream_t stream) {
  CudaDeviceFacts facts;
  return Devices().Require(op, stream, &facts);
}

// fprop (transpose = false) and bprop (transpose = true).
ffi::Error DsdImpl(const char* op, bool transpose, cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer w,
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
  if (ffi::Error e = RequirePrepared(op, stream); e.failure()) return e;
  cudaError_t err = LaunchDsd(dt.in, dt.out_f32, transpose, p, Launch{stream});
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return LaunchError(op, err, DescribeDsd(a, w, *out));
  return ffi::Error::Success();
}

ffi::Error FpropImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> y) {
  return DsdImpl("jbs_bsmm_fprop", false, stream, x, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, order, y);
}

ffi::Error BpropImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> dx) {
  return DsdImpl("jbs_bsmm_bprop", true, stream, g, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, order, dx);
}

ffi::Error UpdatImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer block_rows,
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
  if (ffi::Error e = RequirePrepared(op, stream); e.failure()) return e;
  cudaError_t err = LaunchSdd(dt.in, dt.out_f32, p, Launch{stream});
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return LaunchError(op, err, DescribeSdd(x, dy, *dw));
  return ffi::Error::Success();
}

// Initialize stage of every target (the same for all three).
ffi::Error InitializeImpl(cudaStream_t stream) {
  return Devices().PrepareStreamDevice("jbs_bsmm (initialize)", stream);
}

}  // namespace
}  // namespace jbs

// Bindings. Initialize: the stream only (it reads no operand). Execute: the shared
// operand lists (bsmm_checks.h) after XLA's compute stream. Bind<kInitialize>() rather
// than BindInitialize(), which the FFI headers of the oldest supported jaxlib lack.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JbsBsmmInitializeCuda, jbs::InitializeImpl,
    ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>().Ctx<ffi::PlatformStream<cudaStream_t>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmFpropCuda, jbs::FpropImpl, jbs::BindDsd<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmBpropCuda, jbs::BpropImpl, jbs::BindDsd<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmUpdatCuda, jbs::UpdatImpl, jbs::BindSdd<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});
