// Quantized GEMV, v3: Y[M, N] = X'[M, K] @ W^T over weights repacked once when the model loads
// (kernels.gemv.repack; the GGUF file is never changed): a matrix's quants first, row after row,
// 16 bytes a block for Q4_0 (QTYPE 0: GGUF's nibble order) or 32 for Q8_0 (QTYPE 1), then its
// fp16 scales, row after row. Every 16 bytes of quants (a chunk: a Q4_0 block, half a Q8_0 one)
// then starts 16-byte aligned, so a lane loads its chunk straight into registers in one load and
// decodes it there: v2's round trip of the weights through threadgroup memory (and the shifts
// that joined blocks which GGUF packs across 4-byte words) is gone. Nsight Compute on v2 found
// it waiting on those shared-memory loads and on the fixed latency of its dot-product chains,
// at 22-35% occupancy (kernels/gemv/NOTES.md).
//
// X' (X, RMSNorm(X) * gamma, silu(gate) * up: LATHE_PROLOGUE) is staged in threadgroup memory as
// int16 with a scale per block of 32 (x_stage.metal, shared with v2), in XCHUNK values of K at
// a time (all of K in one chunk where it fits: every M = 1 shape up to K = 16384), laid out so
// that the 32 lanes of a SIMD group, on consecutive chunks, read consecutive 16-byte words.
// Each SIMD group takes R rows at a time (a row group; several, one after another, when the host
// launches fewer threadgroups than row groups: about one wave, X' staged once). Lane l takes
// chunks l, l + 32, ... of each row, P of them at a time: all R x P 16-byte loads are issued
// before any is used (the first P before X' is staged), then decoded with exact integer dot
// products (int16 X' by the 4-bit or int8 weights, two per dp2a on NVIDIA), scaled by d_w * d_x
// into fp32 sums; Q4_0's -8 is taken off as 8 * the block's sum of X' ints. A SIMD sum ends a row.
//
// Constants: QTYPE, M (rows of X, 1..4), R, NSIMD, P, K (a multiple of 32), XCHUNK (a multiple of
// 32, at most K rounded up). Inputs: x, w (the repacked bytes), dims (int32: N, K, threadgroups
// launched); prologue 1 adds gamma (half, K) and eps (float, 1); LATHE_RESIDUAL adds residual
// (half, [M, N]) to Y before its one rounding.
constexpr uint QB = QTYPE == 0 ? 16 : 32;    // bytes of a block's quants
constexpr uint VALS = QTYPE == 0 ? 32 : 16;  // values of K in a chunk (16 bytes of quants)
constexpr uint UNITS = VALS / 8;             // 16-byte words of staged X' a chunk reads
constexpr uint NB = K / 32;                  // blocks a row
constexpr uint NC = K / VALS;                // chunks a row
constexpr uint XC = XCHUNK / VALS;           // chunks of one X' chunk
constexpr uint CHUNKS = (NC + XC - 1) / XC;  // X' chunks
constexpr uint CPL = (XC + 31) / 32;         // a lane's chunks of a row in one X' chunk
constexpr uint NT = NSIMD * 32;

threadgroup uint4 x_tile[M * UNITS * XC];    // X' as int16: word u of chunk c at [u * XC + c]
threadgroup float x_scale[M * XCHUNK / 32];  // d_x of each block
threadgroup int x_sum[M * XCHUNK / 32];      // sum of each block's int16 values
threadgroup float inv_rms[M];                // LATHE_PROLOGUE 1: 1 / RMS of each row of X
threadgroup float scratch[NSIMD];            // ... and its threadgroup sum

const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
const uint tid = thread_index_in_threadgroup;
const uint group = threadgroup_position_in_grid.x;
const uint n = uint(dims[0]);
const uint k = K;
const uint nb = NB;
const uint scales = n * NB * QB / 2;  // the first scale, in 2-byte words of w

// The row groups of this SIMD group: first, first + stride, ... (a SIMD group past N still takes
// one, empty: it meets the staging's barriers like the others). Where X' comes in several chunks
// the host launches one row group a SIMD group, and the items are the chunks instead.
const uint n_groups = (n + R - 1) / R;
const uint stride = uint(dims[2]) * NSIMD;
const uint first = group * NSIMD + simd;
const uint mine = first < n_groups ? (n_groups - first + stride - 1) / stride : 1;
const uint items = CHUNKS == 1 ? mine : CHUNKS;

float acc[R][M];
for (uint r = 0; r < uint(R); ++r) {
  for (uint m = 0; m < uint(M); ++m) acc[r][m] = 0.0f;
}
for (uint it = 0; it < items; ++it) {
  const uint row0 = (first + (CHUNKS == 1 ? it : 0) * stride) * R;
  const uint ck = CHUNKS == 1 ? 0 : it;
  const uint xc0 = ck * XC;               // the X' chunk's first chunk of the row
  const uint cn = min(XC, NC - xc0);      // ... and how many it has
  for (uint pass = 0; pass < CPL; pass += P) {
    // 1. The weights of P chunks of each of the R rows (zero past N or past the row's end).
    uint4 q[R][P];
    float dw[R][P];
    LATHE_UNROLL
    for (uint r = 0; r < uint(R); ++r) {
      LATHE_UNROLL
      for (uint p = 0; p < uint(P); ++p) {
        const uint c = lane + 32 * (pass + p);
        const bool live = row0 + r < n && c < cn;
        const uint row = live ? row0 + r : 0;
        q[r][p] = live ? load_wide<uint4>(w, row * NC + xc0 + c) : uint4{0u, 0u, 0u, 0u};
        dw[r][p] = live ? float(as_type<half>(load_wide<ushort>(w, scales + row * NB + (xc0 + c) * VALS / 32)))
                        : 0.0f;
      }
    }
    // 2. X' (the first time, or each chunk of it), while those loads are on their way.
    if (pass == 0 && (CHUNKS > 1 || it == 0)) {
      const uint cb0 = ck * (XCHUNK / 32);
#define X_STORE(m, e, packed)                                                                  \
  {                                                                                            \
    const uint at = ((m) * UNITS + ((e) % VALS) / 8) * XC + (e) / VALS;                       \
    x_tile[at] = uint4{packed[0], packed[1], packed[2], packed[3]};                            \
    x_tile[at + XC] = uint4{packed[4], packed[5], packed[6], packed[7]};                       \
  }
#include "gemv/x_stage.metal"
#undef X_STORE
    }
    // 3. The dot products: 16-byte words of X' shared by the R rows.
    LATHE_UNROLL
    for (uint p = 0; p < uint(P); ++p) {
      const uint c = lane + 32 * (pass + p);
      if (pass + p >= CPL || c >= cn) continue;
      const uint blk = c * VALS / 32;  // the block within the X' chunk
      uint xw[M][UNITS * 4];
      float dx[M];
      int offset[M];
      for (uint m = 0; m < uint(M); ++m) {
        LATHE_UNROLL
        for (uint u = 0; u < UNITS; ++u) {
          const uint4 v = x_tile[(m * UNITS + u) * XC + c];
          xw[m][4 * u] = v.x, xw[m][4 * u + 1] = v.y, xw[m][4 * u + 2] = v.z, xw[m][4 * u + 3] = v.w;
        }
        dx[m] = x_scale[m * (XCHUNK / 32) + blk];
        offset[m] = QTYPE == 0 ? 8 * x_sum[m * (XCHUNK / 32) + blk] : 0;
      }
      LATHE_UNROLL
      for (uint r = 0; r < uint(R); ++r) {
        const uint qw[4] = {q[r][p].x, q[r][p].y, q[r][p].z, q[r][p].w};
        for (uint m = 0; m < uint(M); ++m) {
          // Two chains of dot products (a long one waits on each step's latency).
          int lo_dot = 0, hi_dot = 0;
          LATHE_UNROLL
          for (uint t = 0; t < 4; ++t) {
            if (QTYPE == 0) {  // word t: values 4t.. (low nibbles) and 16 + 4t.. (high nibbles)
              const uint lo = qw[t] & 0x0f0f0f0fu, hi = (qw[t] >> 4) & 0x0f0f0f0fu;
              lo_dot = dot2_lo(xw[m][2 * t], lo, lo_dot);
              lo_dot = dot2_hi(xw[m][2 * t + 1], lo, lo_dot);
              hi_dot = dot2_lo(xw[m][8 + 2 * t], hi, hi_dot);
              hi_dot = dot2_hi(xw[m][8 + 2 * t + 1], hi, hi_dot);
            } else if (t % 2 == 0) {  // values 4t.. of the chunk
              lo_dot = dot2_lo(xw[m][2 * t], qw[t], lo_dot);
              lo_dot = dot2_hi(xw[m][2 * t + 1], qw[t], lo_dot);
            } else {
              hi_dot = dot2_lo(xw[m][2 * t], qw[t], hi_dot);
              hi_dot = dot2_hi(xw[m][2 * t + 1], qw[t], hi_dot);
            }
          }
          acc[r][m] = fma(dw[r][p] * dx[m], float(lo_dot + hi_dot - offset[m]), acc[r][m]);
        }
      }
    }
  }
  if (ck == CHUNKS - 1) {  // the row group's last X' chunk: its rows are done
    for (uint r = 0; r < uint(R); ++r) {
      for (uint m = 0; m < uint(M); ++m) {
        const float total = simd_sum(acc[r][m]);
        acc[r][m] = 0.0f;
        if (lane == 0 && row0 + r < n) {
#if LATHE_RESIDUAL
          y[m * n + row0 + r] = half(total + float(residual[m * n + row0 + r]));
#else
          y[m * n + row0 + r] = half(total);
#endif
        }
      }
    }
  }
}
