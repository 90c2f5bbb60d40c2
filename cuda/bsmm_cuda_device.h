// Per-device preparation of the CUDA handlers, shared by the Ampere-design targets
// (bsmm_cuda_handlers.cc) and the Hopper ones (sm90/bsmm_sm90_handlers.cc): which device a
// stream runs on, preparing a kernel family there once (module loading, shared-memory
// limits: never during CUDA-graph capture), the device's facts, and the error texts.
//
// Each handler file holds one PreparedDevices for its kernel family. Its initialize stage
// calls PrepareStreamDevice (XLA runs it outside any capture); its execute stage calls
// Require, which only reads the current device and the capture status unless the device
// was never prepared (then it prepares it where that is legal, or returns an error).
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_CUDA_DEVICE_H_
#define JAX_BLOCKSPARSE_CUDA_BSMM_CUDA_DEVICE_H_

#include <map>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>

#include "bsmm_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jbs {

// What the handlers need to know of a device.
struct CudaDeviceFacts {
  int major = 0;
  int minor = 0;
  int num_sms = 0;
};

// "<op>: <what> (<CUDA's error string>)".
std::string CudaErrorText(const char* op, const std::string& what, cudaError_t err);

// Internal "<op>: kernel launch failed (...) for <operands>".
xla::ffi::Error LaunchError(const char* op, cudaError_t err, const Operands& shapes);

class PreparedDevices {
 public:
  // Prepares the family's kernels on the current device (PrepareKernels, PrepareKernelsSm90).
  using Status = cudaError_t;
  using Prepare = Status (*)();
  // Success where the family runs on a device with these facts, else the error to return
  // (nullptr: every device).
  using Accept = xla::ffi::Error (*)(const char* op, int device, const CudaDeviceFacts& facts);

  PreparedDevices(Prepare prepare, Accept accept) : prepare_(prepare), accept_(accept) {}
  PreparedDevices(const PreparedDevices&) = delete;
  PreparedDevices& operator=(const PreparedDevices&) = delete;

  // Reads the device of `stream`, checks it (Accept) and prepares the kernels there, once
  // per device. Never while a stream is capturing: the initialize stage, or execute
  // outside capture.
  xla::ffi::Error PrepareStreamDevice(const char* op, cudaStream_t stream);

  // Execute stage: the facts of the current device (XLA makes the stream's device
  // current), preparing it first where it never was and the stream is not capturing.
  xla::ffi::Error Require(const char* op, cudaStream_t stream, CudaDeviceFacts* facts);

 private:
  bool Find(int device, CudaDeviceFacts* facts);

  Prepare prepare_;
  Accept accept_;
  std::mutex mutex_;
  std::map<int, CudaDeviceFacts> devices_;  // the prepared devices
};

}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_BSMM_CUDA_DEVICE_H_
