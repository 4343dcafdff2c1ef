// The quantized GEMM for a few rows of X on Hopper's (Ampere's) warp MMA: a native CUDA variant
// beside qmm.metal (DESIGN.md: research variants may exist beside the portable body). Y[M, N] =
// X[M, K] @ W^T for M up to 64, W Q4_0 or Q8_0 in the v3 layout (kernels.gemv.repack: every
// block's quants, row after row, then every fp16 scale) read where it lies: no second copy.
//
// The products are mma.sync m16n8k16 with W as the A operand (16 of its rows a tile) and X^T as B
// (8 of X's rows a tile), so that a warp's 16 W rows meet every row of X from one load of W. The
// K order inside a product is free as long as A and B agree, and it is chosen so that both come
// straight from memory in their own layouts:
//   lane (group q = lane / 4, c = lane % 4) takes W rows q and q + 8 of its tile, and of each run
//   of 4 blocks (128 values of K, a "group") block 4 g + c: one 16-byte load of a Q4_0 block's
//   nibbles (two of Q8_0's 32 bytes) a row. Its fragment slots (2c, 2c + 1) and (2c + 8, 2c + 9)
//   of product s hold 4 consecutive values of that block: Q4_0's values 4w .. 4w + 3 (low
//   nibbles of word w, s = 2w) or 16 + 4w .. (high nibbles, s = 2w + 1); Q8_0's 4s .. 4s + 3.
//   B's lane then needs the same 4 values of X's row 8 j + q: 8 contiguous bytes.
// A warp walks its share of K's groups (every KW-th, so the CTA's warps stream adjacent bytes of
// each row), loading the next group's W before this one's products. NW warps side by side take
// adjacent row tiles and read the same X (L1 serves it once); KW warps split K and add their
// float32 sums through shared memory in a fixed order. Nibbles become halves by the 0x6400 trick
// (1024 + q exactly), less 1032 (or 1152 for Q8_0's bytes), times the block's scale.
//
// Constants (NVRTC -D): QT 0 Q4_0 / 1 Q8_0, M (rows of X, 1..64), N, K (a multiple of 128), TM
// (16-row tiles a warp), NW, KW (warps a CTA along N and K), GATED (W is [gate; up], N = 2F: a
// warp's tiles alternate gate and up rows F apart, Y = silu(gate) * up, [M, F]), RESID (Y + R),
// ENTRY. Inputs: x [M, K] fp16, w (the Packed bytes), residual [M, N] (RESID). Output y fp16.
// Launch: ceil(rows / (16 * TM / (1 + GATED) * NW)) CTAs of 32 NW KW threads, RED_BYTES dynamic.
typedef unsigned int u32;
typedef unsigned short u16;

constexpr int MT = (M + 7) / 8;             // X's 8-row tiles
constexpr int XC = MT < 4 ? MT : 4;          // X's tiles whose loads go out together
constexpr int QB = QT == 0 ? 16 : 32;       // quant bytes a block
constexpr int QV = QB / 16;                 // 16-byte loads a block row
constexpr int GROUPS = K / 128;
constexpr int HT = GATED ? TM / 2 : TM;      // output tiles a warp (gated: a gate and an up tile each)
constexpr int OUT_N = GATED ? N / 2 : N;     // Y's columns
constexpr int ACCS = TM * MT * 4;            // a lane's float32 sums
static_assert(K % 128 == 0, "qmm_mma: K whole groups of 128");
static_assert(!GATED || (TM % 2 == 0 && N % 2 == 0), "qmm_mma: a gated warp takes gate and up tiles in pairs");
static_assert(M >= 1 && M <= 64, "qmm_mma: 1..64 rows of X");

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ uint4 load_w(const unsigned char* p) {  // W: read once, not kept in L1
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 load_x(const u16* p) {  // X: every warp of the SM reads it
  uint2 v;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The W rows of a lane: tile t's rows q and q + 8 (gated: tiles alternate gate and up, F apart);
// a row past the matrix reads the last one (its sums are not stored).
__device__ __forceinline__ u32 w_row(u32 tile_base, int t, int half) {
  u32 r;
  if (GATED) {
    r = (t % 2) * (N / 2) + tile_base + (t / 2) * 16 + half * 8;
    const u32 end = (t % 2 + 1) * (N / 2);
    return r < end ? r : end - 1;
  }
  r = tile_base + t * 16 + half * 8;
  return r < N ? r : N - 1;
}

struct WGroup {
  uint4 q[TM][2][QV];
  u16 d[TM][2];
};

extern "C" __global__ void __launch_bounds__(32 * NW * KW)
ENTRY(const u16* __restrict__ x, const unsigned char* __restrict__ w, const u16* __restrict__ residual,
      u16* __restrict__ y) {
  extern __shared__ float red[];
  const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const u32 wn = warp % NW, wk = warp / NW;
  const u32 q = lane / 4, c = lane % 4;
  // this warp's first output row (gated: of gate's rows and of up's)
  const u32 tile_base = (blockIdx.x * NW + wn) * (16 * HT);
  const unsigned char* quants = w;
  const u16* scales = reinterpret_cast<const u16*>(w + (size_t)N * (K / 32) * QB);
  u32 rows[TM][2];
#pragma unroll
  for (int t = 0; t < TM; ++t) {
    rows[t][0] = w_row(tile_base + q, t, 0);
    rows[t][1] = w_row(tile_base + q, t, 1);
  }
  // X's rows of this lane's B fragments (8 j + q), clamped: past M they are zero below
  const u16* xr[MT];
#pragma unroll
  for (int j = 0; j < MT; ++j) xr[j] = x + (size_t)min(8 * j + (int)q, M - 1) * K + 32 * c;

  float acc[TM][MT][4];
#pragma unroll
  for (int t = 0; t < TM; ++t)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][j][e] = 0.0f;

  auto fetch = [&](WGroup& wg, u32 g) {
    const u32 block = 4 * g + c;
#pragma unroll
    for (int t = 0; t < TM; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const size_t at = (size_t)rows[t][h] * (K / 32) + block;
#pragma unroll
        for (int v = 0; v < QV; ++v) wg.q[t][h][v] = load_w(quants + at * QB + 16 * v);
        wg.d[t][h] = scales[at];
      }
  };

  WGroup cur, nxt;
  u32 g = wk;
  if (g < GROUPS) fetch(cur, g);
  for (; g < GROUPS; g += KW) {
    if (g + KW < GROUPS) fetch(nxt, g + KW);
    u32 dd[TM][2];  // half2 (d, d)
#pragma unroll
    for (int t = 0; t < TM; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) dd[t][h] = (u32)cur.d[t][h] * 0x10001u;
    const u32 k0 = 128 * g;
    // X's tiles in chunks of XC: a chunk's loads for all 8 products go out together, then the
    // products (a load a product would put an L2 round trip on each of them)
#pragma unroll
    for (int j0 = 0; j0 < MT; j0 += XC) {
      uint2 b[8][XC];  // X's 4 values of product s: B's b0 b1 (slots 2c, 2c + 1), b2 b3 (2c + 8, 2c + 9)
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const u32 kx = k0 + (QT == 0 ? 4 * (s / 2) + 16 * (s % 2) : 4 * s);
#pragma unroll
        for (int jj = 0; jj < XC; ++jj) {
          const int j = j0 + jj < MT ? j0 + jj : MT - 1;
          b[s][jj] = load_x(xr[j] + kx);
          if (8 * (j0 + jj) + (int)q >= M) b[s][jj] = make_uint2(0u, 0u);
        }
      }
#pragma unroll
      for (int s = 0; s < 8; ++s) {
#pragma unroll
        for (int t = 0; t < TM; ++t) {
          u32 a[4];  // a0a1 row q, a2a3 row q + 8 (slots 2c, 2c + 1); a4a5, a6a7 (2c + 8, 2c + 9)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            u32 lo, hi;
            if (QT == 0) {
              const uint4 v = cur.q[t][h][0];
              const u32 word = (s / 2) == 0 ? v.x : (s / 2) == 1 ? v.y : (s / 2) == 2 ? v.z : v.w;
              const u32 p01 = prmt(word, 0u, 0x4140u), p23 = prmt(word, 0u, 0x4342u);
              if (s % 2 == 0) {  // low nibbles: 1024 + q, less 1032
                lo = hsub2((p01 & 0x000F000Fu) | 0x64006400u, 0x64086408u);
                hi = hsub2((p23 & 0x000F000Fu) | 0x64006400u, 0x64086408u);
              } else {  // high nibbles: 1024 + 16 q, / 16 less 72
                lo = hfma2((p01 & 0x00F000F0u) | 0x64006400u, 0x2C002C00u, 0xD480D480u);
                hi = hfma2((p23 & 0x00F000F0u) | 0x64006400u, 0x2C002C00u, 0xD480D480u);
              }
            } else {
              const uint4 v = cur.q[t][h][s / 4];
              const u32 word = (s % 4) == 0 ? v.x : (s % 4) == 1 ? v.y : (s % 4) == 2 ? v.z : v.w;
              const u32 u = word ^ 0x80808080u;  // int8 + 128
              lo = hsub2(prmt(u, 0x64646464u, 0x4140u), 0x64806480u);  // 1024 + u, less 1152
              hi = hsub2(prmt(u, 0x64646464u, 0x4342u), 0x64806480u);
            }
            a[h] = hmul2(lo, dd[t][h]);
            a[2 + h] = hmul2(hi, dd[t][h]);
          }
#pragma unroll
          for (int jj = 0; jj < XC; ++jj)
            if (j0 + jj < MT) mma(acc[t][j0 + jj], a, b[s][jj].x, b[s][jj].y);
        }
      }
    }
    if (g + KW < GROUPS) cur = nxt;
  }

  // K's parts: warps wk > 0 hand their sums to wk = 0, which adds them in order
  if (KW > 1) {
    if (wk > 0) {
      float* mine = red + (((wk - 1) * NW + wn) * ACCS) * 32;
#pragma unroll
      for (int t = 0; t < TM; ++t)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) mine[((t * MT + j) * 4 + e) * 32 + lane] = acc[t][j][e];
    }
    __syncthreads();
    if (wk > 0) return;
    for (int p = 0; p < KW - 1; ++p) {
      const float* theirs = red + ((p * NW + wn) * ACCS) * 32;
#pragma unroll
      for (int t = 0; t < TM; ++t)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[t][j][e] += theirs[((t * MT + j) * 4 + e) * 32 + lane];
    }
  }

  // C's lane: rows q (e 0, 1) and q + 8 (e 2, 3) of the tile, X's rows 8 j + 2c and + 1
#pragma unroll
  for (int t = 0; t < HT; ++t)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const u32 col = tile_base + t * 16 + q + (e / 2) * 8;  // Y's column (a W row, or gate's)
        const int row = 8 * j + 2 * (int)c + e % 2;
        if (col >= (u32)OUT_N || row >= M) continue;
        float v;
        if (GATED) {
          const float gv = acc[2 * t][j][e], uv = acc[2 * t + 1][j][e];
          v = gv / (1.0f + __expf(-gv)) * uv;
        } else {
          v = acc[t][j][e];
        }
        if (RESID) v += h2f(residual[(size_t)row * OUT_N + col]);
        y[(size_t)row * OUT_N + col] = f2h(v);
      }
}
