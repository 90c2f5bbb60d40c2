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
// tests/test_cuda_graph_safety.py checks that the capture-unsafe calls stay inside the
// regions marked "capture-unsafe" below and in bsmm_common.cuh.
#include <mutex>
#include <set>
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

// Devices whose kernels PrepareKernels() has prepared.
std::mutex prepared_mutex;
std::set<int> prepared_devices;

bool IsPrepared(int device) {
  std::lock_guard<std::mutex> lock(prepared_mutex);
  return prepared_devices.count(device) > 0;
}

std::string CudaErrorText(const char* op, const std::string& what, cudaError_t err) {
  return std::string(op) + ": " + what + " (" + cudaGetErrorString(err) + ")";
}

// Prepares the kernels on the device of `stream`, once per device. Never call it while
// a stream is capturing: the initialize stage, or execute outside capture, only.
ffi::Error PrepareStreamDevice(const char* op, cudaStream_t stream) {
  // capture-unsafe: begin
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess) return ffi::Error::Internal(CudaErrorText(op, "cannot read the current device", err));
  int device = current;
#if CUDART_VERSION >= 12080
  err = cudaStreamGetDevice(stream, &device);
  if (err != cudaSuccess) return ffi::Error::Internal(CudaErrorText(op, "cannot read the stream's device", err));
#else
  (void)stream;  // XLA has made the stream's device current on this thread
#endif
  std::lock_guard<std::mutex> lock(prepared_mutex);
  if (prepared_devices.count(device) > 0) return ffi::Error::Success();
  if (device != current && (err = cudaSetDevice(device)) != cudaSuccess) {
    return ffi::Error::Internal(CudaErrorText(op, "cannot select device " + std::to_string(device), err));
  }
  err = PrepareKernels();
  if (device != current) {
    cudaError_t restore = cudaSetDevice(current);
    if (err == cudaSuccess) err = restore;
  }
  if (err != cudaSuccess) {
    return ffi::Error::Internal(
        CudaErrorText(op, "cannot prepare the kernels on device " + std::to_string(device), err));
  }
  prepared_devices.insert(device);
  return ffi::Error::Success();
  // capture-unsafe: end
}

// Execute stage: the kernels must be prepared on the current device (XLA makes the
// stream's device current). Normally the initialize stage did it; if it did not, this
// prepares them now where that is legal (no capture), else returns an error.
ffi::Error RequirePrepared(const char* op, cudaStream_t stream) {
  int device = -1;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return ffi::Error::Internal(CudaErrorText(op, "cannot read the current device", err));
  if (IsPrepared(device)) return ffi::Error::Success();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) return ffi::Error::Internal(CudaErrorText(op, "cannot query stream capture", err));
  if (capture == cudaStreamCaptureStatusNone) return PrepareStreamDevice(op, stream);
  return ffi::Error::Internal(std::string(op) + ": the kernels are not prepared on device " + std::to_string(device) +
                              " and the stream is being captured into a CUDA graph, where preparing them is "
                              "illegal (XLA did not run this target's initialize stage first)");
}

ffi::Error LaunchError(const char* op, cudaError_t err, const Operands& shapes) {
  return ffi::Error::Internal(std::string(op) + ": kernel launch failed (" + cudaGetErrorString(err) + ") for " +
                              shapes.str());
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
ffi::Error InitializeImpl(cudaStream_t stream) { return PrepareStreamDevice("jbs_bsmm (initialize)", stream); }

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
