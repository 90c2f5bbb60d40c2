// Helpers shared by the CPU kernel translation units compiled once per instruction set
// (bsmm_cpu_kernels.cc, bsconv_cpu_kernels.cc): 16-bit float conversions, widening and
// narrowing of rows, the vector types and the broadcast load, growable buffers.
//
// Everything here lives in jbs::cpu::JBS_CPU_ISA::(anonymous), so that each translation
// unit, compiled with its own instruction-set flags, gets its own copy (see bsmm_cpu.h
// why no inline function may be shared between them). Include it after defining
// JBS_CPU_ISA and JBS_CPU_LANES (the build does, per instruction set).
#ifndef JAX_BLOCKSPARSE_CUDA_CPU_CPU_SIMD_H_
#define JAX_BLOCKSPARSE_CUDA_CPU_CPU_SIMD_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>  // madvise (huge pages for large buffers)
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // broadcasts (Splat) and transposes; the arithmetic is vector extensions
#endif

#include "bsmm_problem.h"

#if !defined(JBS_CPU_ISA) || !defined(JBS_CPU_LANES)
#error "the build defines JBS_CPU_ISA and JBS_CPU_LANES for the per-ISA kernel files"
#endif

namespace jbs {
namespace cpu {
namespace JBS_CPU_ISA {
namespace {

// ---------------------------------------------------------------------------------
// 16-bit floats (bit patterns in uint16_t), round to nearest even like XLA
// ---------------------------------------------------------------------------------

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t FloatToF16(float f) {
  uint32_t u = FloatToBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (u >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (u < 0x38800000u) {  // below 2^-14: a subnormal (or zero) in units of 2^-24
    const float units = BitsToFloat(u) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(__builtin_rintf(units)));
  }
  u += 0xfffu + ((u >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return static_cast<uint16_t>(sign | ((u - (112u << 23)) >> 13));
}

// Widens `count` elements of dtype `in` to float32.
inline void Widen(DType in, const void* src, float* dst, int count) {
  switch (in) {
    case DType::kF32: std::memcpy(dst, src, sizeof(float) * count); return;
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int i = 0; i < count; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int i = 0; i < count; ++i) dst[i] = F16ToFloat(s[i]);
      return;
    }
  }
}

// Stores `count` float32 values as `out` (float32 or the 16-bit input dtype).
inline void Narrow(const float* src, DType out, void* dst, int count) {
  switch (out) {
    case DType::kF32: std::memcpy(dst, src, sizeof(float) * count); return;
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int i = 0; i < count; ++i) d[i] = FloatToBf16(src[i]);
      return;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int i = 0; i < count; ++i) d[i] = FloatToF16(src[i]);
      return;
    }
  }
}

inline int64_t ElementBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

inline const void* Offset(const void* base, int64_t elements, DType t) {
  return static_cast<const char*>(base) + elements * ElementBytes(t);
}

inline void* Offset(void* base, int64_t elements, DType t) {
  return static_cast<char*>(base) + elements * ElementBytes(t);
}

inline int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t Max(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------
// The register tile
// ---------------------------------------------------------------------------------

typedef float V4 __attribute__((vector_size(16)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V16 __attribute__((vector_size(64)));
// Same, but only 4-byte aligned: for loads and stores at any float address.
typedef float V4u __attribute__((vector_size(16), aligned(4)));
typedef float V8u __attribute__((vector_size(32), aligned(4)));
typedef float V16u __attribute__((vector_size(64), aligned(4)));

template <int L>
struct VecOf;
template <>
struct VecOf<4> {
  typedef V4 type;
  typedef V4u unaligned;
};
template <>
struct VecOf<8> {
  typedef V8 type;
  typedef V8u unaligned;
};
template <>
struct VecOf<16> {
  typedef V16 type;
  typedef V16u unaligned;
};

// Every lane = x, as one broadcast load where the instruction set has it. (Not
// `V{} + x`: that adds 0.0, which the compiler must keep for -0.0, and then broadcasts
// from a register on a port the FMAs need.)
template <typename V, int L>
inline V Splat(const float* x) {
#if defined(__AVX512F__)
  if constexpr (L == 16) return reinterpret_cast<V>(_mm512_set1_ps(*x));
#endif
#if defined(__AVX__)
  if constexpr (L == 8) return reinterpret_cast<V>(_mm256_set1_ps(*x));
#endif
#if defined(__SSE__)
  if constexpr (L == 4) return reinterpret_cast<V>(_mm_set1_ps(*x));
#endif
  V v;
  for (int i = 0; i < L; ++i) v[i] = *x;
  return v;
}

// ---------------------------------------------------------------------------------
// Transposition
// ---------------------------------------------------------------------------------

// dst[j * ldd + i] = src[i * lds + j] for i, j < 8, in vector registers (three rounds of
// shuffles).
#if defined(__AVX__)
inline void Transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

// dst[j * ldd + i] = src[i * BS + j]: a float32 [BS, BS] block transposed, into rows
// `ldd` floats apart (BS: a block; wider: a slice of a panel). With AVX, in 8 x 8 tiles
// held in registers: a scalar copy, each store to another row, ran at about 3.5 cycles
// per element, half of the bprop kernel's time at 16 rows.
template <int BS>
inline void TransposeBlock(const float* src, float* dst, int64_t ldd = BS) {
#if defined(__AVX__)
  if constexpr (BS % 8 == 0) {
    for (int i = 0; i < BS; i += 8) {
      for (int j = 0; j < BS; j += 8) Transpose8x8(src + i * BS + j, BS, dst + j * ldd + i, ldd);
    }
    return;
  }
#endif
  for (int i = 0; i < BS; ++i) {
    for (int j = 0; j < BS; ++j) dst[j * ldd + i] = src[i * BS + j];
  }
}

// dst = the [BS, BS] block src of dtype `in`, widened to float32 and transposed, into rows
// `ldd` floats apart.
template <int BS>
inline void WidenTransposed(DType in, const void* src, float* dst, int64_t ldd = BS) {
  if (in == DType::kF32) return TransposeBlock<BS>(static_cast<const float*>(src), dst, ldd);
  alignas(64) static thread_local float wide[BS * BS];
  Widen(in, src, wide, BS * BS);
  TransposeBlock<BS>(wide, dst, ldd);
}

// ---------------------------------------------------------------------------------
// Scratch memory
// ---------------------------------------------------------------------------------

// A growable 64-byte aligned float buffer (kept by a thread between calls).
struct Buffer {
  float* data = nullptr;
  int64_t floats = 0;
  ~Buffer() { std::free(data); }
  float* Get(int64_t want) {
    if (want > floats) {
      std::free(data);
      data = static_cast<float*>(Allocate(sizeof(float) * want));
      floats = data ? want : 0;
    }
    return data;
  }

 private:
  // Large buffers are aligned to 2 MiB and asked for huge pages: a buffer of 100+ MiB
  // allocated per call (it is freed at the end of each) otherwise costs tens of thousands
  // of page faults, measured at 10% of a bprop's time.
  static void* Allocate(size_t bytes) {
    constexpr size_t kHuge = size_t{2} << 20;
    const bool large = bytes >= 2 * kHuge;
    void* fresh = nullptr;
    if (posix_memalign(&fresh, large ? kHuge : 64, bytes) != 0) return nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (large) madvise(fresh, bytes, MADV_HUGEPAGE);  // advice only: failure changes nothing
#endif
    return fresh;
  }
};

// The slots that hold blocks: the tables' nnz (col_ptr[KB]), never trusted past cap.
inline int64_t SlotsInUse(const int32_t* nnz, int cap) { return Max(0, Min(*nnz, cap)); }

// Buffers of the calling thread kept between calls (what each holds is the kernel file's
// choice). Larger ones are freed at the end of each call (ReleaseLargeBuffers), so that a
// thread keeps at most a few tens of MiB between calls.
constexpr int kCallerBuffers = 4;

inline Buffer& CallerBuffer(int which) {
  static thread_local Buffer buffers[kCallerBuffers];
  return buffers[which];
}

inline void ReleaseLargeBuffers() {
  constexpr int64_t kKeepFloats = int64_t{8} << 20;  // 32 MiB
  for (int i = 0; i < kCallerBuffers; ++i) {
    Buffer& b = CallerBuffer(i);
    if (b.floats > kKeepFloats) {
      std::free(b.data);
      b.data = nullptr;
      b.floats = 0;
    }
  }
}

// Where updat sums each slot's block of dw across chunks of rows: dw itself when it is
// float32; else, over several chunks, a float32 [cap, bs, bs] caller buffer (2); else
// nullptr, each slot summing in per-thread scratch and narrowing at once. *ok is false
// when there is no memory for the buffer.
inline float* SddAccumulators(const SddParams& p, bool out_f32, int64_t chunks, bool* ok) {
  *ok = true;
  if (out_f32) return static_cast<float*>(p.dw);
  if (chunks <= 1) return nullptr;
  float* buffer = CallerBuffer(2).Get(int64_t{p.cap} * p.bs * p.bs);
  *ok = buffer != nullptr;
  return buffer;
}

}  // namespace
}  // namespace JBS_CPU_ISA
}  // namespace cpu
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_CPU_CPU_SIMD_H_
