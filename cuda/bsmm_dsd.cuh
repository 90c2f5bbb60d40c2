// DSD kernels (fprop, and bprop with the tables swapped): dense x block-sparse -> dense.
//
// Work decomposition (both kernels): one CTA computes a tile of TN rows x one output
// block (BS columns). The 1-D grid is (position in `order`) major, row tile minor, so
// the CTAs of the longest output blocks are issued first (`order` sorts the output
// blocks longest-first; the layout builds it with its other tables, layout.py).
//
// The reduction of one output block runs over the concatenated k-ranges of its entries
// (nent * BS values of k). It is cut into stages of KC consecutive k values. A stage is
// made of KC / W "pieces" of width W = min(KC, BS): with BS >= KC a piece is a KC-wide
// slice of one entry's block, with BS < KC a piece is a whole entry (several entries
// per stage, so small blocks still fill a k16 tensor-core step). A piece past the last
// entry, of a padding slot or of an out-of-range input block is zero-filled in shared
// memory, so it contributes exactly nothing. Rows >= n are zero-filled the same way and
// never stored. Every output element of the tile is stored, zero for empty blocks.
#ifndef JAX_BLOCKSPARSE_CUDA_BSMM_DSD_CUH_
#define JAX_BLOCKSPARSE_CUDA_BSMM_DSD_CUH_

#include "bsmm_common.cuh"

namespace jbs {
namespace detail {

// Where one piece of a stage comes from. `ok` false: zero-fill.
struct Piece {
  int64_t a_col;  // first column of the piece in a row of `a`
  int64_t w_off;  // element offset of the slot's block in `w`
  int k_off;      // first k of the piece inside the block (0 when BS <= KC)
  bool ok;
};

// Piece `q` of stage `t` of an output block whose entries are [start, start + nent).
template <int BS, int KC>
__device__ __forceinline__ Piece GetPiece(const DsdParams& p, int start, int nent, int nnz, int t, int q) {
  constexpr int W = KC < BS ? KC : BS;
  const int kg = t * KC + q * W;  // position in the concatenated k range (< nent * BS)
  const int e = kg / BS;
  Piece pc;
  pc.k_off = kg - e * BS;
  pc.ok = e < nent;
  int slot = 0, ib = 0;
  if (pc.ok) {
    const int entry = start + e;
    slot = p.seg_slots != nullptr ? __ldg(p.seg_slots + entry) : entry;
    pc.ok = slot >= 0 && slot < nnz;
  }
  if (pc.ok) {
    ib = __ldg(p.in_block + slot);
    pc.ok = ib >= 0 && ib < p.nin;
  }
  if (!pc.ok) slot = ib = 0;
  pc.a_col = static_cast<int64_t>(ib) * BS + pc.k_off;
  pc.w_off = static_cast<int64_t>(slot) * BS * BS;
  return pc;
}

// Which output block and row tile this CTA owns; false when it has nothing to do.
struct DsdTile {
  int seg, start, nent, nnz;
  int64_t row0;
};

template <int TN>
__device__ __forceinline__ bool GetDsdTile(const DsdParams& p, DsdTile& tile) {
  const int64_t ntiles = (p.n + TN - 1) / TN;
  const int64_t lin = blockIdx.x;
  const int64_t pos = lin / ntiles;
  tile.row0 = (lin - pos * ntiles) * TN;
  if (pos >= p.nseg) return false;
  tile.seg = __ldg(p.order + pos);
  if (tile.seg < 0 || tile.seg >= p.nseg) return false;  // `order` is a permutation
  tile.nnz = LoadNnz(p.nnz, p.cap);
  tile.start = Clamp(__ldg(p.seg_ptr + tile.seg), 0, p.cap);
  const int end = Clamp(__ldg(p.seg_ptr + tile.seg + 1), tile.start, p.cap);
  tile.nent = end - tile.start;
  return true;
}

// ---------------------------------------------------------------------------------
// 16-bit inputs: tensor cores (mma.sync m16n8k16), ldmatrix, cp.async multistage.
// ---------------------------------------------------------------------------------
// Warps form a WM x WN grid over the TN x BS tile; each warp owns (TN/WM) x (BS/WN).
// Shared memory per stage: A [TN][KC + 8] (rows of a, k contiguous) and B either
// [KC][BS + 8] (fprop: k rows, n contiguous, read with ldmatrix.trans) or
// [BS][KC + 8] (bprop: n rows = rows of w[s], k contiguous, read with ldmatrix).
// The +8 element pad makes every ldmatrix phase conflict free (row strides of 80, 272,
// 144 bytes...).
template <int BS, int TN, int WM, int WN, int KC, int STAGES, bool TRANS_W>
struct DsdTcShape {
  static constexpr int kThreads = WM * WN * 32;
  static constexpr int kWtm = TN / WM;
  static constexpr int kWtn = BS / WN;
  static constexpr int kMt = kWtm / 16;
  static constexpr int kNt = kWtn / 8;
  static constexpr int kW = KC < BS ? KC : BS;
  static constexpr int kPieces = KC / kW;
  static constexpr int kAStride = KC + 8;
  static constexpr int kBRows = TRANS_W ? BS : KC;
  static constexpr int kBStride = TRANS_W ? KC + 8 : BS + 8;
  static constexpr int kAElems = TN * kAStride;
  static constexpr int kStageElems = kAElems + kBRows * kBStride;
  static constexpr int kSmemBytes = STAGES * kStageElems * 2;
  static_assert(KC % 16 == 0 && KC % 8 == 0, "KC must be a multiple of 16");
  static_assert(KC % kW == 0, "pieces must tile a stage");
  static_assert(kWtm % 16 == 0 && kWtn % 8 == 0, "warp tile must be a multiple of 16 x 8");
  static_assert(kNt == 1 || kNt % 2 == 0, "B fragments are loaded two n-tiles at a time");
  static_assert(STAGES >= 2, "need at least double buffering");
};

template <typename T, typename OutT, int BS, int TN, int WM, int WN, int KC, int STAGES, bool TRANS_W>
__global__ void __launch_bounds__(WM * WN * 32) DsdTcKernel(const DsdParams p) {
  using S = DsdTcShape<BS, TN, WM, WN, KC, STAGES, TRANS_W>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);

  DsdTile tile;
  if (!GetDsdTile<TN>(p, tile)) return;  // uniform over the CTA
  const T* const a = static_cast<const T*>(p.a);
  const T* const w = static_cast<const T*>(p.w);
  const int64_t lda = static_cast<int64_t>(p.nin) * BS;
  const int tid = threadIdx.x;
  const int nstages = (tile.nent * BS + KC - 1) / KC;

  auto load_stage = [&](int t, int buf) {
    T* const As = smem + buf * S::kStageElems;
    T* const Bs = As + S::kAElems;
#pragma unroll
    for (int q = 0; q < S::kPieces; ++q) {
      const Piece pc = GetPiece<BS, KC>(p, tile.start, tile.nent, tile.nnz, t, q);
      // A: TN rows x W columns of this piece, 8 elements (16 bytes) per copy.
      constexpr int kAChunks = TN * (S::kW / 8);
      for (int c = tid; c < kAChunks; c += S::kThreads) {
        const int r = c / (S::kW / 8);
        const int kk = (c - r * (S::kW / 8)) * 8;
        const int64_t row = tile.row0 + r;
        T* dst = As + r * S::kAStride + q * S::kW + kk;
        if (pc.ok && row < p.n) CpAsync16(dst, a + row * lda + pc.a_col + kk);
        else Zero16(dst);
      }
      // B: W values of k x BS values of n of this piece.
      constexpr int kBChunks = S::kW * BS / 8;
      for (int c = tid; c < kBChunks; c += S::kThreads) {
        if constexpr (!TRANS_W) {  // Bs[k][n] = w[s][k_off + kr][n]
          const int kr = c / (BS / 8);
          const int nn = (c - kr * (BS / 8)) * 8;
          T* dst = Bs + (q * S::kW + kr) * S::kBStride + nn;
          if (pc.ok) CpAsync16(dst, w + pc.w_off + static_cast<int64_t>(pc.k_off + kr) * BS + nn);
          else Zero16(dst);
        } else {  // Bs[n][k] = w[s][n][k_off + kk]  (B = w[s]^T)
          const int nr = c / (S::kW / 8);
          const int kk = (c - nr * (S::kW / 8)) * 8;
          T* dst = Bs + nr * S::kBStride + q * S::kW + kk;
          if (pc.ok) CpAsync16(dst, w + pc.w_off + static_cast<int64_t>(nr) * BS + pc.k_off + kk);
          else Zero16(dst);
        }
      }
    }
  };

  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp / WN;
  const int wn = warp - wm * WN;
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

  for (int t = 0; t < nstages; ++t) {
    CpAsyncWait<STAGES - 2>();  // stage t has landed (one commit group per stage)
    __syncthreads();            // ... for every thread; buffer (t - 1) % STAGES is free
    {
      const int tn = t + STAGES - 1;
      if (tn < nstages) load_stage(tn, tn % STAGES);
      CpAsyncCommit();
    }
    const T* const As = smem + (t % STAGES) * S::kStageElems;
    const T* const Bs = As + S::kAElems;
#pragma unroll
    for (int ks = 0; ks < KC / 16; ++ks) {
      uint32_t af[S::kMt][4];
#pragma unroll
      for (int i = 0; i < S::kMt; ++i) {
        // matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
        const int r = wm * S::kWtm + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int k = ks * 16 + (lane >> 4) * 8;
        Ldsm4(af[i], As + r * S::kAStride + k);
      }
      uint32_t bfr[S::kNt][2];
      if constexpr (S::kNt == 1) {
        uint32_t r2[2];
        if constexpr (!TRANS_W) {  // matrices: (k 0-7), (k 8-15) of Bs[k][n]
          const int k = ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
          Ldsm2T(r2, Bs + k * S::kBStride + wn * S::kWtn);
        } else {  // matrices: (k 0-7), (k 8-15) of Bs[n][k]
          const int nrow = wn * S::kWtn + (lane & 7);
          const int k = ks * 16 + ((lane >> 3) & 1) * 8;
          Ldsm2(r2, Bs + nrow * S::kBStride + k);
        }
        bfr[0][0] = r2[0];
        bfr[0][1] = r2[1];
      } else {
#pragma unroll
        for (int jp = 0; jp < S::kNt / 2; ++jp) {
          // matrices: (k 0-7, n-tile 2jp), (k 8-15, 2jp), (k 0-7, 2jp+1), (k 8-15, 2jp+1)
          const int mat = lane >> 3;
          uint32_t r4[4];
          if constexpr (!TRANS_W) {
            const int k = ks * 16 + (mat & 1) * 8 + (lane & 7);
            const int nn = wn * S::kWtn + jp * 16 + (mat >> 1) * 8;
            Ldsm4T(r4, Bs + k * S::kBStride + nn);
          } else {
            const int nrow = wn * S::kWtn + jp * 16 + (mat >> 1) * 8 + (lane & 7);
            const int k = ks * 16 + (mat & 1) * 8;
            Ldsm4(r4, Bs + nrow * S::kBStride + k);
          }
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

  // Epilogue: every (row < n, column) of the tile, zero for empty output blocks.
  OutT* const out = static_cast<OutT*>(p.out);
  const int64_t ldo = static_cast<int64_t>(p.nseg) * BS;
  const int g = lane >> 2;
  const int qd = lane & 3;
#pragma unroll
  for (int i = 0; i < S::kMt; ++i) {
    const int64_t row = tile.row0 + wm * S::kWtm + i * 16 + g;
#pragma unroll
    for (int j = 0; j < S::kNt; ++j) {
      const int64_t col = static_cast<int64_t>(tile.seg) * BS + wn * S::kWtn + j * 8 + 2 * qd;
      if (row < p.n) Store2(out + row * ldo + col, acc[i][j][0], acc[i][j][1]);
      if (row + 8 < p.n) Store2(out + (row + 8) * ldo + col, acc[i][j][2], acc[i][j][3]);
    }
  }
}

template <typename T, typename OutT, int BS, int TN, int WM, int WN, int KC, int STAGES, bool TRANS_W>
cudaError_t LaunchDsdTc(const DsdParams& p, const Launch& launch) {
  using S = DsdTcShape<BS, TN, WM, WN, KC, STAGES, TRANS_W>;
  auto kernel = DsdTcKernel<T, OutT, BS, TN, WM, WN, KC, STAGES, TRANS_W>;
  if (launch.prepare_only) return PrepareKernel(kernel, S::kSmemBytes);
  const int64_t ntiles = (p.n + TN - 1) / TN;
  const int64_t grid = ntiles * p.nseg;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7fffffff) return cudaErrorInvalidConfiguration;
  kernel<<<static_cast<unsigned>(grid), S::kThreads, S::kSmemBytes, launch.stream>>>(p);
  return cudaGetLastError();
}

// Block-size table of the tensor-core DSD kernel (TN rows per CTA, warp grid, k per stage).
template <typename T, typename OutT, bool TRANS_W>
cudaError_t DispatchDsdTc(const DsdParams& p, const Launch& launch) {
  switch (p.bs) {
    case 8: return LaunchDsdTc<T, OutT, 8, 128, 4, 1, 32, 3, TRANS_W>(p, launch);
    case 16: return LaunchDsdTc<T, OutT, 16, 128, 4, 1, 32, 3, TRANS_W>(p, launch);
    case 32: return LaunchDsdTc<T, OutT, 32, 128, 4, 1, 32, 3, TRANS_W>(p, launch);
    case 64: return LaunchDsdTc<T, OutT, 64, 128, 4, 2, 32, 3, TRANS_W>(p, launch);
    case 128: return LaunchDsdTc<T, OutT, 128, 128, 2, 4, 32, 3, TRANS_W>(p, launch);
    default: return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------------
// float32 inputs: SIMT FMA in float32 (no tf32), register tiles of RM x RN per thread.
// ---------------------------------------------------------------------------------
// Threads form TY x TX over the TN x BS tile; thread (ty, tx) owns rows ty + i*TY and
// columns tx + j*TX. Shared memory: As[k][row] (transposed, +1 pad) and Bs[k][n].
template <int BS, int TN, int TX, int TY, int KC, bool TRANS_W>
__global__ void __launch_bounds__(TX* TY) DsdF32Kernel(const DsdParams p) {
  constexpr int kThreads = TX * TY;
  constexpr int RM = TN / TY;
  constexpr int RN = BS / TX;
  constexpr int W = KC < BS ? KC : BS;
  constexpr int kPieces = KC / W;
  static_assert(RM * TY == TN && RN * TX == BS && kPieces * W == KC, "bad f32 tile");
  __shared__ float As[KC][TN + 1];
  __shared__ float Bs[KC][BS + 1];

  DsdTile tile;
  if (!GetDsdTile<TN>(p, tile)) return;
  const float* const a = static_cast<const float*>(p.a);
  const float* const w = static_cast<const float*>(p.w);
  const int64_t lda = static_cast<int64_t>(p.nin) * BS;
  const int tid = threadIdx.x;
  const int tx = tid % TX;
  const int ty = tid / TX;
  const int nstages = (tile.nent * BS + KC - 1) / KC;

  float acc[RM][RN];
#pragma unroll
  for (int i = 0; i < RM; ++i)
#pragma unroll
    for (int j = 0; j < RN; ++j) acc[i][j] = 0.f;

  for (int t = 0; t < nstages; ++t) {
#pragma unroll
    for (int q = 0; q < kPieces; ++q) {
      const Piece pc = GetPiece<BS, KC>(p, tile.start, tile.nent, tile.nnz, t, q);
      for (int c = tid; c < TN * W; c += kThreads) {
        const int r = c / W;
        const int kk = c - r * W;
        const int64_t row = tile.row0 + r;
        As[q * W + kk][r] = (pc.ok && row < p.n) ? __ldg(a + row * lda + pc.a_col + kk) : 0.f;
      }
      for (int c = tid; c < W * BS; c += kThreads) {
        if constexpr (!TRANS_W) {  // Bs[k][n] = w[s][k_off + kr][n]
          const int kr = c / BS;
          const int nn = c - kr * BS;
          Bs[q * W + kr][nn] = pc.ok ? __ldg(w + pc.w_off + static_cast<int64_t>(pc.k_off + kr) * BS + nn) : 0.f;
        } else {  // Bs[k][n] = w[s][n][k_off + kk]
          const int nn = c / W;
          const int kk = c - nn * W;
          Bs[q * W + kk][nn] = pc.ok ? __ldg(w + pc.w_off + static_cast<int64_t>(nn) * BS + pc.k_off + kk) : 0.f;
        }
      }
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < KC; ++k) {
      float av[RM], bv[RN];
#pragma unroll
      for (int i = 0; i < RM; ++i) av[i] = As[k][ty + i * TY];
#pragma unroll
      for (int j = 0; j < RN; ++j) bv[j] = Bs[k][tx + j * TX];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }

  float* const out = static_cast<float*>(p.out);
  const int64_t ldo = static_cast<int64_t>(p.nseg) * BS;
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const int64_t row = tile.row0 + ty + i * TY;
    if (row >= p.n) continue;
#pragma unroll
    for (int j = 0; j < RN; ++j) out[row * ldo + static_cast<int64_t>(tile.seg) * BS + tx + j * TX] = acc[i][j];
  }
}

template <int BS, int TN, int TX, int TY, int KC, bool TRANS_W>
cudaError_t LaunchDsdF32Tile(const DsdParams& p, const Launch& launch) {
  auto kernel = DsdF32Kernel<BS, TN, TX, TY, KC, TRANS_W>;
  if (launch.prepare_only) return PrepareKernel(kernel, 0);
  const int64_t ntiles = (p.n + TN - 1) / TN;
  const int64_t grid = ntiles * p.nseg;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7fffffff) return cudaErrorInvalidConfiguration;
  kernel<<<static_cast<unsigned>(grid), TX * TY, 0, launch.stream>>>(p);
  return cudaGetLastError();
}

template <bool TRANS_W>
cudaError_t DispatchDsdF32(const DsdParams& p, const Launch& launch) {
  switch (p.bs) {
    case 8: return LaunchDsdF32Tile<8, 128, 8, 32, 16, TRANS_W>(p, launch);
    case 16: return LaunchDsdF32Tile<16, 64, 16, 16, 16, TRANS_W>(p, launch);
    case 32: return LaunchDsdF32Tile<32, 64, 16, 16, 16, TRANS_W>(p, launch);
    case 64: return LaunchDsdF32Tile<64, 64, 16, 16, 16, TRANS_W>(p, launch);
    case 128: return LaunchDsdF32Tile<128, 64, 16, 16, 16, TRANS_W>(p, launch);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace detail
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_BSMM_DSD_CUH_
