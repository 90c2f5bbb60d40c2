// Per-device preparation of the CUDA handlers (bsmm_cuda_device.h).
#include "bsmm_cuda_device.h"

namespace ffi = xla::ffi;

namespace jbs {

std::string CudaErrorText(const char* op, const std::string& what, cudaError_t err) {
  return std::string(op) + ": " + what + " (" + cudaGetErrorString(err) + ")";
}

ffi::Error LaunchError(const char* op, cudaError_t err, const Operands& shapes) {
  return ffi::Error::Internal(std::string(op) + ": kernel launch failed (" + cudaGetErrorString(err) + ") for " +
                              shapes.str());
}

bool PreparedDevices::Find(int device, CudaDeviceFacts* facts) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = devices_.find(device);
  if (it == devices_.end()) return false;
  *facts = it->second;
  return true;
}

ffi::Error PreparedDevices::PrepareStreamDevice(const char* op, cudaStream_t stream) {
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
  std::lock_guard<std::mutex> lock(mutex_);
  if (devices_.count(device) > 0) return ffi::Error::Success();
  CudaDeviceFacts facts;
  if ((err = cudaDeviceGetAttribute(&facts.major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&facts.minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&facts.num_sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) {
    return ffi::Error::Internal(
        CudaErrorText(op, "cannot read the attributes of device " + std::to_string(device), err));
  }
  if (accept_ != nullptr) {
    if (ffi::Error e = accept_(op, device, facts); e.failure()) return e;
  }
  if (device != current && (err = cudaSetDevice(device)) != cudaSuccess) {
    return ffi::Error::Internal(CudaErrorText(op, "cannot select device " + std::to_string(device), err));
  }
  err = prepare_();
  if (device != current) {
    cudaError_t restore = cudaSetDevice(current);
    if (err == cudaSuccess) err = restore;
  }
  if (err != cudaSuccess) {
    return ffi::Error::Internal(
        CudaErrorText(op, "cannot prepare the kernels on device " + std::to_string(device), err));
  }
  devices_[device] = facts;
  return ffi::Error::Success();
  // capture-unsafe: end
}

ffi::Error PreparedDevices::Require(const char* op, cudaStream_t stream, CudaDeviceFacts* facts) {
  int device = -1;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return ffi::Error::Internal(CudaErrorText(op, "cannot read the current device", err));
  if (Find(device, facts)) return ffi::Error::Success();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) return ffi::Error::Internal(CudaErrorText(op, "cannot query stream capture", err));
  if (capture != cudaStreamCaptureStatusNone) {
    return ffi::Error::Internal(std::string(op) + ": the kernels are not prepared on device " + std::to_string(device) +
                                " and the stream is being captured into a CUDA graph, where preparing them is "
                                "illegal (XLA did not run this target's initialize stage first)");
  }
  if (ffi::Error e = PrepareStreamDevice(op, stream); e.failure()) return e;
  if (!Find(device, facts)) return ffi::Error::Internal(std::string(op) + ": device preparation failed");
  return ffi::Error::Success();
}

}  // namespace jbs
