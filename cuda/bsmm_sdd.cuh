// SDD kernels (updat): dw[s] = x[:, rows[s]-block]^T @ dy[:, cols[s]-block] over all n.
//
// Work decomposition: one CTA owns G consecutive slots (G = 1 for big blocks, several
// for small ones, one or more warps per slot) and loops over the n rows in stages of TK
// rows. Slot s >= nnz (padding) or with an out-of-range block index reads nothing and
// stores zeros; a CTA whose slots are all padding stores zeros and leaves at once.
// Rows >= n are zero-filled in shared memory. Every dw element of a slot < cap is
// stored exactly once.
//
// Tile reuse: slots are stored sorted by output block column, so the G slots of a CTA
// mostly share their column and with it the dy tile of every stage. Each stage loads
// the dy tile of a column once, into the place of the first of the CTA's slots with
// that column (`y_src`); the other slots read it from there. x tiles differ per slot
// (different block rows) and are loaded per slot.
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_SDD_CUH_
#define JAX_BLOCKSPARSE_CUDA_BSMM_SDD_CUH_

#include "bsmm_common.cuh"

namespace jbs {
namespace detail {

// Per-slot source columns, computed once per CTA by threads < G into shared memory.
// y_src[g]: the first g' <= g whose valid slot has the same dy column as slot g (g
// itself when none, and for invalid slots), whose dy tile slot g reads.
template <int BS, int G>
__device__ __forceinline__ void LoadSlotInfo(const SddParams& p, int nnz, int64_t (&x_col)[G], int64_t (&y_col)[G],
                                             int (&valid)[G], int (&y_src)[G]) {
  const int g = threadIdx.x;
  if (g < G) {
    const int slot = blockIdx.x * G + g;
    bool ok = slot < nnz;  // nnz <= cap
    int r = 0, c = 0;
    if (ok) {
      r = __ldg(p.block_rows + slot);
      c = __ldg(p.block_cols + slot);
      ok = r >= 0 && r < p.cb && c >= 0 && c < p.kb;
    }
    if (!ok) r = c = 0;
    x_col[g] = static_cast<int64_t>(r) * BS;
    y_col[g] = static_cast<int64_t>(c) * BS;
    valid[g] = ok ? 1 : 0;
  }
  __syncthreads();
  if (g < G) {
    int src = g;
    if (valid[g]) {
      for (int h = 0; h < g; ++h) {
        if (valid[h] && y_col[h] == y_col[g]) {
          src = h;
          break;
        }
      }
    }
    y_src[g] = src;
  }
}

// ---------------------------------------------------------------------------------
// 16-bit inputs: tensor cores. A = x-block^T (m = x block column, k = row of x),
// B = dy-block (k = row, n = dy block column). Both are staged row-major as
// [TK][BS + 8] (k rows), so A is read with ldmatrix.trans and B with ldmatrix.trans.
// Warps of one slot form a WPM x WPN grid over its BS x BS output; for BS = 8 the
// m16 tile is half empty (the upper 8 rows of A are zero registers, never stored).
// ---------------------------------------------------------------------------------
template <int BS, int G, int WPM, int WPN, int TK, int STAGES>
struct SddTcShape {
  static constexpr int kWarpsPerSlot = WPM * WPN;
  static constexpr int kThreads = G * kWarpsPerSlot * 32;
  static constexpr int kWtm = BS / WPM < 16 ? 16 : BS / WPM;
  static constexpr int kWtn = BS / WPN;
  static constexpr int kMt = kWtm / 16;
  static constexpr int kNt = kWtn / 8;
  static constexpr int kStride = BS + 8;
  static constexpr int kTileElems = TK * kStride;         // one matrix of one slot
  static constexpr int kStageElems = 2 * G * kTileElems;  // x and dy of every slot
  static constexpr int kSmemBytes = STAGES * kStageElems * 2;
  static_assert(BS >= 16 || (WPM == 1 && BS == 8), "BS = 8 uses one half-empty m16 tile");
  static_assert(BS < 16 || (BS / WPM) % 16 == 0, "warp m tile must be a multiple of 16");
  static_assert(kWtn % 8 == 0 && (kNt == 1 || kNt % 2 == 0), "warp n tile");
  static_assert(TK % 16 == 0 && STAGES >= 2, "stages");
};

template <typename T, typename OutT, int BS, int G, int WPM, int WPN, int TK, int STAGES>
__global__ void __launch_bounds__(G * WPM * WPN * 32) SddTcKernel(const SddParams p) {
  using S = SddTcShape<BS, G, WPM, WPN, TK, STAGES>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  __shared__ int64_t x_col[G], y_col[G];
  __shared__ int valid[G], y_src[G];

  const int nnz = LoadNnz(p.nnz, p.cap);
  LoadSlotInfo<BS, G>(p, nnz, x_col, y_col, valid, y_src);
  __syncthreads();
  const int tid = threadIdx.x;
  const int64_t slot0 = static_cast<int64_t>(blockIdx.x) * G;
  OutT* const dw = static_cast<OutT*>(p.dw);

  int any = 0;
#pragma unroll
  for (int g = 0; g < G; ++g) any |= valid[g];
  if (!any) {  // all padding: zeros (uniform branch, no barrier after it)
    for (int64_t i = tid; i < static_cast<int64_t>(G) * BS * BS; i += S::kThreads) {
      const int64_t slot = slot0 + i / (BS * BS);
      if (slot < p.cap) dw[slot0 * BS * BS + i] = OutT(0.f);
    }
    return;
  }

  const T* const x = static_cast<const T*>(p.x);
  const T* const dy = static_cast<const T*>(p.dy);
  const int64_t ldx = static_cast<int64_t>(p.cb) * BS;
  const int64_t ldy = static_cast<int64_t>(p.kb) * BS;
  const int64_t nstages = (p.n + TK - 1) / TK;

  auto load_stage = [&](int64_t t, int buf) {
    T* const base = smem + buf * S::kStageElems;
    constexpr int kChunksPerTile = TK * (BS / 8);
    constexpr int kChunks = 2 * G * kChunksPerTile;
    for (int c = tid; c < kChunks; c += S::kThreads) {
      const int which = c / (G * kChunksPerTile);  // 0: x, 1: dy
      const int rest = c - which * (G * kChunksPerTile);
      const int g = rest / kChunksPerTile;
      const int cc = rest - g * kChunksPerTile;
      const int r = cc / (BS / 8);
      const int col = (cc - r * (BS / 8)) * 8;
      const int64_t row = t * TK + r;
      if (which == 1 && y_src[g] != g) continue;  // this dy tile is loaded for slot y_src[g]
      T* dst = base + (which * G + g) * S::kTileElems + r * S::kStride + col;
      if (valid[g] && row < p.n) {
        const T* src = which == 0 ? x + row * ldx + x_col[g] + col : dy + row * ldy + y_col[g] + col;
        CpAsync16(dst, src);
      } else {
        Zero16(dst);
      }
    }
  };

  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = warp / S::kWarpsPerSlot;
  const int wi = warp - g * S::kWarpsPerSlot;
  const int wm = wi / WPN;
  const int wn = wi - wm * WPN;
  float acc[S::kMt][S::kNt][4];
#pragma unroll
  for (int i = 0; i < S::kMt; ++i)
#pragma unroll
    for (int j = 0; j < S::kNt; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nstages) load_stage(s, s);
    CpAsyncCommit();
  }
  for (int64_t t = 0; t < nstages; ++t) {
    CpAsyncWait<STAGES - 2>();
    __syncthreads();
    {
      const int64_t tn = t + STAGES - 1;
      if (tn < nstages) load_stage(tn, static_cast<int>(tn % STAGES));
      CpAsyncCommit();
    }
    const T* const stage = smem + static_cast<int>(t % STAGES) * S::kStageElems;
    const T* const Xs = stage + g * S::kTileElems;
    const T* const Ys = stage + (G + y_src[g]) * S::kTileElems;
#pragma unroll
    for (int ks = 0; ks < TK / 16; ++ks) {
      uint32_t af[S::kMt][4];
      if constexpr (BS == 8) {
        // matrices: (k 0-7, m 0-7) -> a0, (k 8-15, m 0-7) -> a2; rows m 8-15 do not exist
        uint32_t r2[2];
        const int k = ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
        Ldsm2T(r2, Xs + k * S::kStride);
        af[0][0] = r2[0];
        af[0][1] = 0u;
        af[0][2] = r2[1];
        af[0][3] = 0u;
      } else {
#pragma unroll
        for (int i = 0; i < S::kMt; ++i) {
          // A[m][k] = Xs[k][m]; matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15),
          // (m 8-15, k 8-15), each stored with k as the row: read transposed.
          const int mat = lane >> 3;
          const int k = ks * 16 + (mat >> 1) * 8 + (lane & 7);
          const int m = wm * S::kWtm + i * 16 + (mat & 1) * 8;
          Ldsm4T(af[i], Xs + k * S::kStride + m);
        }
      }
      uint32_t bfr[S::kNt][2];
      if constexpr (S::kNt == 1) {
        uint32_t r2[2];
        const int k = ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
        Ldsm2T(r2, Ys + k * S::kStride + wn * S::kWtn);
        bfr[0][0] = r2[0];
        bfr[0][1] = r2[1];
      } else {
#pragma unroll
        for (int jp = 0; jp < S::kNt / 2; ++jp) {
          const int mat = lane >> 3;
          const int k = ks * 16 + (mat & 1) * 8 + (lane & 7);
          const int nn = wn * S::kWtn + jp * 16 + (mat >> 1) * 8;
          uint32_t r4[4];
          Ldsm4T(r4, Ys + k * S::kStride + nn);
          bfr[2 * jp][0] = r4[0];
          bfr[2 * jp][1] = r4[1];
          bfr[2 * jp + 1][0] = r4[2];
          bfr[2 * jp + 1][1] = r4[3];
        }
      }
#pragma unroll
      for (int i = 0; i < S::kMt; ++i)
#pragma unroll
        for (int j = 0; j < S::kNt; ++j) Mma16816<T>(acc[i][j], af[i], bfr[j]);
    }
  }
  CpAsyncWait<0>();

  const int64_t slot = slot0 + g;
  if (slot >= p.cap) return;
  const float keep = valid[g] ? 1.f : 0.f;  // padding slots store exact zeros
  OutT* const out = dw + slot * BS * BS;
  const int gq = lane >> 2;
  const int qd = lane & 3;
#pragma unroll
  for (int i = 0; i < S::kMt; ++i) {
    const int m = wm * S::kWtm + i * 16 + gq;
#pragma unroll
    for (int j = 0; j < S::kNt; ++j) {
      const int nn = wn * S::kWtn + j * 8 + 2 * qd;
      if (m < BS) Store2(out + m * BS + nn, keep * acc[i][j][0], keep * acc[i][j][1]);
      if (m + 8 < BS) Store2(out + (m + 8) * BS + nn, keep * acc[i][j][2], keep * acc[i][j][3]);
    }
  }
}

template <typename T, typename OutT, int BS, int G, int WPM, int WPN, int TK, int STAGES>
cudaError_t LaunchSddTc(const SddParams& p, const Launch& launch) {
  using S = SddTcShape<BS, G, WPM, WPN, TK, STAGES>;
  auto kernel = SddTcKernel<T, OutT, BS, G, WPM, WPN, TK, STAGES>;
  if (launch.prepare_only) return PrepareKernel(kernel, S::kSmemBytes);
  const int64_t grid = (static_cast<int64_t>(p.cap) + G - 1) / G;
  if (grid == 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(grid), S::kThreads, S::kSmemBytes, launch.stream>>>(p);
  return cudaGetLastError();
}

// Block-size table of the tensor-core SDD kernel (slots per CTA, warps per slot, rows per stage).
template <typename T, typename OutT>
cudaError_t DispatchSddTc(const SddParams& p, const Launch& launch) {
  switch (p.bs) {
    case 8: return LaunchSddTc<T, OutT, 8, 8, 1, 1, 32, 3>(p, launch);
    case 16: return LaunchSddTc<T, OutT, 16, 4, 1, 1, 32, 3>(p, launch);
    case 32: return LaunchSddTc<T, OutT, 32, 4, 1, 1, 32, 3>(p, launch);
    case 64: return LaunchSddTc<T, OutT, 64, 1, 2, 2, 32, 3>(p, launch);
    case 128: return LaunchSddTc<T, OutT, 128, 1, 2, 4, 32, 3>(p, launch);
    default: return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------------
// float32 inputs: SIMT FMA. Threads of one slot form TY x TX over its BS x BS output
// (RM x RN outputs each); G = 256 / (TX * TY) slots per CTA.
// ---------------------------------------------------------------------------------
template <int BS, int RM, int RN, int TK>
__global__ void __launch_bounds__(256) SddF32Kernel(const SddParams p) {
  constexpr int TX = BS / RN, TY = BS / RM, TPS = TX * TY, G = 256 / TPS;
  static_assert(G * TPS == 256 && G >= 1, "bad f32 updat tile");
  __shared__ float Xs[G][TK][BS];
  __shared__ float Ys[G][TK][BS];
  __shared__ int64_t x_col[G], y_col[G];
  __shared__ int valid[G], y_src[G];

  const int nnz = LoadNnz(p.nnz, p.cap);
  LoadSlotInfo<BS, G>(p, nnz, x_col, y_col, valid, y_src);
  __syncthreads();
  const int tid = threadIdx.x;
  const int g = tid / TPS;
  const int local = tid - g * TPS;
  const int tx = local % TX;
  const int ty = local / TX;
  const float* const x = static_cast<const float*>(p.x);
  const float* const dy = static_cast<const float*>(p.dy);
  const int64_t ldx = static_cast<int64_t>(p.cb) * BS;
  const int64_t ldy = static_cast<int64_t>(p.kb) * BS;

  int any = 0;
#pragma unroll
  for (int i = 0; i < G; ++i) any |= valid[i];

  float acc[RM][RN];
#pragma unroll
  for (int i = 0; i < RM; ++i)
#pragma unroll
    for (int j = 0; j < RN; ++j) acc[i][j] = 0.f;

  const int64_t nstages = any ? (p.n + TK - 1) / TK : 0;
  for (int64_t t = 0; t < nstages; ++t) {
    for (int c = tid; c < G * TK * BS; c += 256) {
      const int gg = c / (TK * BS);
      const int r = (c / BS) % TK;
      const int col = c % BS;
      const int64_t row = t * TK + r;
      const bool ok = valid[gg] && row < p.n;
      Xs[gg][r][col] = ok ? __ldg(x + row * ldx + x_col[gg] + col) : 0.f;
      if (y_src[gg] == gg) Ys[gg][r][col] = ok ? __ldg(dy + row * ldy + y_col[gg] + col) : 0.f;
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < TK; ++k) {
      float av[RM], bv[RN];
#pragma unroll
      for (int i = 0; i < RM; ++i) av[i] = Xs[g][k][ty + i * TY];
#pragma unroll
      for (int j = 0; j < RN; ++j) bv[j] = Ys[y_src[g]][k][tx + j * TX];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }

  const int64_t slot = static_cast<int64_t>(blockIdx.x) * G + g;
  if (slot >= p.cap) return;
  const float keep = valid[g] ? 1.f : 0.f;
  float* const out = static_cast<float*>(p.dw) + slot * BS * BS;
#pragma unroll
  for (int i = 0; i < RM; ++i)
#pragma unroll
    for (int j = 0; j < RN; ++j) out[(ty + i * TY) * BS + tx + j * TX] = keep * acc[i][j];
}

template <int BS, int RM, int RN>
cudaError_t LaunchSddF32Tile(const SddParams& p, const Launch& launch) {
  constexpr int G = 256 / ((BS / RN) * (BS / RM));
  auto kernel = SddF32Kernel<BS, RM, RN, 16>;
  if (launch.prepare_only) return PrepareKernel(kernel, 0);
  const int64_t grid = (static_cast<int64_t>(p.cap) + G - 1) / G;
  if (grid == 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(grid), 256, 0, launch.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_BSMM_SDD_CUH_
