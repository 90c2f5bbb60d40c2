// Facts about the CUDA half of the extension, for the pybind11 module (module.cc),
// which is compiled by the host compiler without CUDA headers.
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_CUDA_INFO_H_
#define JAX_BLOCKSPARSE_CUDA_BSMM_CUDA_INFO_H_

namespace jbs {

// CUDART_VERSION of the toolkit the handlers were compiled with (e.g. 13000).
int CudaRuntimeVersionBuiltAgainst();
// cudaRuntimeGetVersion of the statically linked runtime, or -1.
int CudaRuntimeVersionLinked();

}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_BSMM_CUDA_INFO_H_
