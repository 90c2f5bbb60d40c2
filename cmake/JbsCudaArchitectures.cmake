# Which CUDA architectures the extension is built for, and where nvcc is.
#
# The architectures use CMake's own form (CMAKE_CUDA_ARCHITECTURES): "80-real" is SASS
# for sm_80, "90-virtual" PTX for compute_90, a bare "90a" both. They come from the
# CMake variable CMAKE_CUDA_ARCHITECTURES, else the environment variable CUDAARCHS
# (CMake's convention for initializing it), else the GPUs nvidia-smi reports.

# out: TRUE when the environment variable `name` is set to anything but "" or "0".
function(jbs_env_flag out name)
  if(NOT "$ENV{${name}}" STREQUAL "" AND NOT "$ENV{${name}}" STREQUAL "0")
    set(${out} TRUE PARENT_SCOPE)
  else()
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()

# out: one X.Y-real per compute capability nvidia-smi reports (9.0 -> 90a-real: the
# Hopper kernels need the arch-specific target); empty without nvidia-smi or a GPU.
function(jbs_detect_cuda_architectures out)
  set(archs)
  find_program(_jbs_smi nvidia-smi NO_CACHE)
  if(_jbs_smi)
    execute_process(COMMAND "${_jbs_smi}" --query-gpu=compute_cap --format=csv,noheader
                    TIMEOUT 20 OUTPUT_VARIABLE caps RESULT_VARIABLE rc ERROR_QUIET
                    OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc EQUAL 0)
      string(REPLACE "\n" ";" caps "${caps}")
      foreach(cap IN LISTS caps)
        string(STRIP "${cap}" cap)
        if(cap STREQUAL "9.0")
          list(APPEND archs 90a-real)
        elseif(cap MATCHES "^([0-9]+)\\.([0-9]+)$")
          list(APPEND archs "${CMAKE_MATCH_1}${CMAKE_MATCH_2}-real")
        endif()
      endforeach()
      list(REMOVE_DUPLICATES archs)
      if(archs)
        message(STATUS "jax-blocksparse: GPUs seen by nvidia-smi: compute capability ${caps} -> ${archs}")
      endif()
    endif()
  endif()
  set(${out} "${archs}" PARENT_SCOPE)
endfunction()

# out: the architectures to build for (validated), or empty for none.
function(jbs_cuda_architectures out)
  if(DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT "${CMAKE_CUDA_ARCHITECTURES}" STREQUAL "")
    set(archs "${CMAKE_CUDA_ARCHITECTURES}")
    set(origin "CMAKE_CUDA_ARCHITECTURES")
  elseif(NOT "$ENV{CUDAARCHS}" STREQUAL "")
    set(archs "$ENV{CUDAARCHS}")
    set(origin "CUDAARCHS")
  else()
    jbs_detect_cuda_architectures(archs)
    set(origin "nvidia-smi")
  endif()
  foreach(arch IN LISTS archs)
    if(NOT arch MATCHES "^[0-9]+[af]?(-real|-virtual)?$")
      message(FATAL_ERROR "jax-blocksparse: ${origin}: expected architectures such as "
                          "\"80-real;90a-real;90-virtual\" (NN[a][-real|-virtual]), got \"${archs}\"")
    endif()
  endforeach()
  set(${out} "${archs}" PARENT_SCOPE)
endfunction()

# Sets the cache variable CMAKE_CUDA_COMPILER unless given: $CUDACXX, else nvcc under
# $CUDA_HOME or $CUDA_PATH, on the PATH, or in /usr/local/cuda; NOTFOUND without one.
macro(jbs_find_nvcc)
  if(NOT CMAKE_CUDA_COMPILER)
    if(NOT "$ENV{CUDACXX}" STREQUAL "")
      set(_jbs_nvcc "$ENV{CUDACXX}")
    else()
      find_program(_jbs_nvcc nvcc HINTS "$ENV{CUDA_HOME}/bin" "$ENV{CUDA_PATH}/bin"
                   PATHS /usr/local/cuda/bin NO_CACHE)
    endif()
    if(_jbs_nvcc)
      set(CMAKE_CUDA_COMPILER "${_jbs_nvcc}" CACHE FILEPATH "The CUDA compiler" FORCE)
    endif()
  endif()
endmacro()

# out: ON when sm_90a (in any form: 90a, 90a-real, 90a-virtual) is among `archs`.
function(jbs_has_hopper out archs)
  set(result OFF)
  foreach(arch IN LISTS archs)
    if(arch MATCHES "^90a(-real|-virtual)?$")
      set(result ON)
    endif()
  endforeach()
  set(${out} ${result} PARENT_SCOPE)
endfunction()

# out: `archs` as nvcc names them: 80-real -> sm_80, 90-virtual -> compute_90, 90a ->
# sm_90a;compute_90a (what build_info() reports).
function(jbs_arch_names out archs)
  set(names)
  foreach(arch IN LISTS archs)
    string(REGEX MATCH "^[0-9]+[af]?" number "${arch}")
    if(arch MATCHES "-real$")
      list(APPEND names "sm_${number}")
    elseif(arch MATCHES "-virtual$")
      list(APPEND names "compute_${number}")
    else()
      list(APPEND names "sm_${number}" "compute_${number}")
    endif()
  endforeach()
  set(${out} "${names}" PARENT_SCOPE)
endfunction()
