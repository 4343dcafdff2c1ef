// One v3 GEMV over the row groups of threadgroup `group` (of dims[2]), included inside a scope that
// names: x, w, dims, y (and gamma, eps, residual as LATHE_PROLOGUE / LATHE_RESIDUAL need them),
// `group`, this GEMV's K, R, P and block type as compile-time constants KR, RR, PR and QR (a
// launch of several GEMVs gives each its own rows, depth and type: blocks/layer_block.metal), and
// the declarations of v3_tiles.metal (NSIMD and the staged X' are the launch's). GEMV_Y_STRIDE,
// where the includer defines it: the values of a row of Y (else this GEMV's columns; gemv_v3.metal's
// pair writes two matrices' columns side by side). GEMV_BIAS, where defined: a pointer to this
// GEMV's N biases (half), added to each output before its one rounding. GEMV_ON_Y(m, col, out),
// where defined: run in lane 0 after Y[m, col] is written, with the half it wrote; a SIMD group's
// columns come in rising order. GEMV_X_CODES (with GEMV_X_SCALES, GEMV_X_SUMS), where defined: X'
// as another phase quantized it, copied (gemv/x_codes.metal), not staged from x. GEMV_Y_CODES
// (with GEMV_Y_SCALES, GEMV_Y_SUMS, GEMV_Y_COUNTS), where defined: Y also quantized as the next
// GEMV's X', each block by the last row group to write it (gemv/y_codes.metal).
// QR: 0 Q4_0, 1 Q8_0, and the K-quants 2 Q4_K, 3 Q5_K, 4 Q6_K, whose repacked chunk is 32
// weights' low 4 bits in Q4_0's nibble order, their higher bits (HB bytes a chunk) and scales in
// regions of their own (reference/kquant.py has the layout); the legacy affine blocks 6 Q4_1,
// 7 Q5_0, 8 Q5_1 repacked the same way, a chunk a block, its d (and m) in the scales region
// (reference/quant.py's pack_legacy): Q4_K's arithmetic, d * level - offset; and the IQ4s, 9
// IQ4_NL (d a chunk) and 10 IQ4_XS (each super-block's 8-byte head), whose nibbles index
// lathe.h's iq4_levels (reference/iquant.py's pack).
// gemv_v3.metal runs it once as its own threadgroup; seam.metal runs two GEMVs, each over groups
// it claims. The design is gemv_v3.metal's.
// This GEMV's chunk (16 bytes of its quants: RV values of K) need not be the staging's (VALS, the
// launch's QTYPE): a Q8_0 GEMV reads half of a staged 32-value chunk, a 32-value GEMV two staged
// 16-value chunks, so any block types share a launch (llama.cpp's Q4_K_M mixes Q8_0 in).
constexpr uint RV = QR == 1 ? 16 : 32;       // values of K in this GEMV's chunk
constexpr uint RUNITS = RV / 8;              // 16-byte words of staged X' this GEMV's chunk reads
constexpr uint RXC = XCHUNK / RV;            // this GEMV's chunks of one X' chunk
constexpr bool KQUANT = QR >= 2;             // the repacked regions (K-quants and legacy blocks)
constexpr bool LEGACY = QR >= 6 && QR <= 8;  // Q4_1, Q5_0, Q5_1: a scale (and min) a chunk
constexpr bool IQ4 = QR == 9 || QR == 10;     // nibbles through a table of int8 levels
constexpr bool FIFTH = QR == 3 || QR == 7 || QR == 8;  // a fifth bit a weight (Q5_K, Q5_0, Q5_1)
constexpr uint QB = QR == 1 ? 32 : 16;       // bytes of a block's quants (K-quants: a chunk's low bits)
constexpr uint HB = FIFTH ? 4 : QR == 4 ? 8 : 0;  // K-quants: bytes of high bits a chunk
constexpr uint SB = QR == 6 || QR == 8 ? 4 : QR == 10 ? 1 : 2;  // bytes of scales a chunk (K-quants: 16 a super-block)
constexpr uint NB = KR / 32;                 // blocks a row
constexpr uint NC = KR / RV;                 // chunks a row
constexpr uint CHUNKS = (NC + RXC - 1) / RXC;  // X' chunks
// A lane's chunks of a row in one X' chunk. GEMV_ROW_PASSES (default 1): to the row's own chunks
// where one X' chunk holds them all; else to the X' chunk's, whose XCHUNK is the launch's longest K
// in the blocks, so the 8B token's QKV, O and gate|up ran 3 passes of dead loads after their one.
#ifndef GEMV_ROW_PASSES
#define GEMV_ROW_PASSES 1
#endif
// GEMV_RMS_LATE (the includer's; v3_tiles.metal sizes scratch for it): with the RMSNorm prologue
// and X' in one chunk, the staging takes no pass over X first (x_stage.metal's X_RMS_LATE) and the
// epilogue scales each row's sums by its 1 / RMS. Several chunks keep the pass (each chunk's
// codes would need the row's scale before the row is whole), as does a K that is neither whole
// 512s nor 512 / 2^j (a SIMD group's 32 items of 16 values would split a row unevenly).
#ifndef GEMV_RMS_LATE
#define GEMV_RMS_LATE 0
#endif
#if LATHE_PROLOGUE == 1 && !defined(GEMV_X_CODES)
constexpr bool rms_late = GEMV_RMS_LATE && CHUNKS == 1 && (KR % 512 == 0 || 512 % KR == 0);
#else
constexpr bool rms_late = false;
#endif
constexpr uint CPL = ((GEMV_ROW_PASSES && NC < RXC ? NC : RXC) + 31) / 32;
const uint n = uint(dims[0]);
const uint k = KR;
const uint nb = NB;
const uint scales = n * NB * QB / 2;  // Q4_0/Q8_0: the first scale, in 2-byte words of w
// K-quants: the first high-bit word and the first super-block's scales, in bytes of w
const uint k_high = n * NC * 16, k_scales = k_high + n * NC * HB;

// LATHE_EPILOGUE 1 (SwiGLU out): W is [gate; up], F = N / 2 rows each, and Y[m, i] =
// act(X' . gate_i) * (X' . up_i) for i < F (SiLU; GELU with LATHE_ACT 1). A row group is then RR / 2 outputs: its first RR / 2
// rows are the gate rows of those outputs and its last RR / 2 their up rows, so both sums of an
// output end in one SIMD group and meet in lane 0 (no [M, 2F] round trip through memory).
#ifndef LATHE_ACT
#define LATHE_ACT 0  // the gate's activation (lathe.h's gate_act): SiLU unless the prelude says
#endif
#if defined(LATHE_EPILOGUE) && LATHE_EPILOGUE == 1
constexpr bool SWIGLU_OUT = true;
#else
constexpr bool SWIGLU_OUT = false;
#endif
static_assert(!SWIGLU_OUT || RR % 2 == 0, "SwiGLU out pairs a gate row with an up row: RR must be even");
constexpr uint RO = SWIGLU_OUT ? RR / 2 : RR;  // outputs of a row group
const uint n_out = SWIGLU_OUT ? n / 2 : n;   // columns of Y
#ifdef GEMV_Y_STRIDE
const uint y_stride = GEMV_Y_STRIDE;
#else
const uint y_stride = n_out;
#endif

// The row groups of this SIMD group: first, first + stride, ... (a SIMD group past N still takes
// one, empty: it meets the staging's barriers like the others). Where X' comes in several chunks
// the host launches one row group a SIMD group, and the items are the chunks instead.
const uint n_groups = (n_out + RO - 1) / RO;
const uint stride = uint(dims[2]) * NSIMD;
const uint first = group * NSIMD + simd;
const uint mine = first < n_groups ? (n_groups - first + stride - 1) / stride : 1;
const uint items = CHUNKS == 1 ? mine : CHUNKS;

float acc[RR][M];
for (uint r = 0; r < uint(RR); ++r) {
  for (uint m = 0; m < uint(M); ++m) acc[r][m] = 0.0f;
}
for (uint it = 0; it < items; ++it) {
  const uint col0 = (first + (CHUNKS == 1 ? it : 0) * stride) * RO;  // the row group's first column of Y
  const uint ck = CHUNKS == 1 ? 0 : it;
  const uint xc0 = ck * RXC;              // the X' chunk's first chunk of the row
  const uint cn = min(RXC, NC - xc0);      // ... and how many it has
  for (uint pass = 0; pass < CPL; pass += PR) {
    // 1. The weights of PR chunks of each of the RR rows (zero past N or past the row's end).
    uint4 q[RR][PR];
    float dw[RR][PR];  // the block's scale (K-quants: of the chunk's first 16 values, d * sc)
    float dk[RR][PR];  // K-quants: Q4_K/Q5_K dmin * m, Q6_K the last 16 values' d * sc
    uint hb[RR][PR][HB > 4 ? 2 : 1];  // K-quants: the chunk's high bits
    LATHE_UNROLL
    for (uint r = 0; r < uint(RR); ++r) {
      LATHE_UNROLL
      for (uint p = 0; p < uint(PR); ++p) {
        const uint c = lane + 32 * (pass + p);
        const uint col = col0 + r % RO;  // row r's column of Y; SwiGLU out: its up row is F rows on
        const bool live = col < n_out && c < cn;
        const uint row = live ? col + (r >= RO ? n_out : 0) : 0;
        const uint chunk = row * NC + xc0 + c;  // of the whole matrix
        q[r][p] = live ? load_wide<uint4>(w, chunk) : uint4{0u, 0u, 0u, 0u};
        if (!KQUANT) {
          dw[r][p] = live ? float(as_type<half>(load_wide<ushort>(w, scales + row * NB + (xc0 + c) * RV / 32)))
                          : 0.0f;
        } else if (IQ4) {
          // IQ4_NL: the block's d; IQ4_XS: the super-block's d times its 6-bit scale of sub-block
          // j = chunk % 8, less 32 (GGML's dl), from the head's scales_h and scales_l
          if (QR == 9) {
            dw[r][p] = live ? float(as_type<half>(load_wide<ushort>(w, k_scales / 2 + chunk))) : 0.0f;
          } else {
            const uint2 head = live ? load_wide<uint2>(w, k_scales / 8 + chunk / 8) : uint2{0u, 0u};
            const uint j = chunk % 8;
            const uint ls = ((head.y >> (4 * j)) & 15u) | (((head.x >> (16 + 2 * j)) & 3u) << 4);
            dw[r][p] = float(as_type<half>(ushort(head.x & 0xffffu))) * float(int(ls) - 32);
          }
          dk[r][p] = 0.0f;
          hb[r][p][0] = 0u;
        } else if (LEGACY) {
          // the block's fp16 d (Q5_0: offset 16 d) or d and m (Q4_1, Q5_1: offset -m)
          if (QR == 7) {
            const float d = live ? float(as_type<half>(load_wide<ushort>(w, k_scales / 2 + chunk))) : 0.0f;
            dw[r][p] = d;
            dk[r][p] = 16.0f * d;
          } else {
            const half2 dm = live ? as_type<half2>(load_wide<uint>(w, k_scales / 4 + chunk)) : half2(half(0.0f), half(0.0f));
            dw[r][p] = float(dm.x);
            dk[r][p] = -float(dm.y);
          }
          hb[r][p][0] = FIFTH && live ? load_wide<uint>(w, k_high / 4 + chunk) : 0u;
        } else if (QR == 4) {
          // two int8 scales (the chunk's two sub-blocks of 16), and the super-block's fp16 d
          const uint pair = live ? uint(load_wide<ushort>(w, k_scales / 2 + chunk)) : 0u;
          const float d = live ? float(as_type<half>(load_wide<ushort>(w, (k_scales + n * NC * 2) / 2 + chunk / 8)))
                               : 0.0f;
          dw[r][p] = d * float(int(pair << 24) >> 24);
          dk[r][p] = d * float(int(pair << 16) >> 24);
          const uint2 h = live ? load_wide<uint2>(w, k_high / 8 + chunk) : uint2{0u, 0u};
          hb[r][p][0] = h.x;
          hb[r][p][HB > 4 ? 1 : 0] = h.y;
        } else {
          // the super-block's d, dmin and 6-bit scales and mins (GGML's get_scale_min_k4) of
          // sub-block j = chunk % 8: bytes j (j < 4) or j - 4 of the three scale words
          const uint4 head = live ? load_wide<uint4>(w, k_scales / 16 + chunk / 8) : uint4{0u, 0u, 0u, 0u};
          const uint j = chunk % 8, shift = 8 * (j % 4);
          const uint b0 = (head.y >> shift) & 255u, b1 = (head.z >> shift) & 255u, b2 = (head.w >> shift) & 255u;
          const uint sc = j < 4 ? b0 & 63u : (b2 & 15u) | ((b0 >> 6) << 4);
          const uint mn = j < 4 ? b1 & 63u : (b2 >> 4) | ((b1 >> 6) << 4);
          const half2 dd = as_type<half2>(head.x);
          dw[r][p] = float(dd.x) * float(sc);
          dk[r][p] = float(dd.y) * float(mn);
          hb[r][p][0] = QR == 3 && live ? load_wide<uint>(w, k_high / 4 + chunk) : 0u;
        }
      }
    }
    // 2. X' (the first time, or each chunk of it), while those loads are on their way.
    if (pass == 0 && (CHUNKS > 1 || it == 0)) {
#ifdef GEMV_BEFORE_X
      if (it == 0) {
#ifdef GEMV_L2_AHEAD
        // The rest of this SIMD group's rows into the L2 before the includer's wait, which then
        // overlaps their DRAM reads too, not only the first PR chunks' (blocks/layer_block.metal).
        if (GEMV_L2_AHEAD) {
          for (uint i = 0; i < (CHUNKS == 1 ? mine : 1u); ++i) {
            const uint c0 = (first + i * stride) * RO;
            if (c0 >= n_out) break;
            const size_t rows = min(RO, n_out - c0);
            for (uint h = 0; h < (SWIGLU_OUT ? 2u : 1u); ++h) {  // SwiGLU out: the gate rows, then the up rows
              const size_t r0 = c0 + h * n_out;
              prefetch_l2(w, r0 * NC * 16, rows * NC * 16, lane, 32);  // the quants: 16 bytes a chunk
              if (!KQUANT) {
                prefetch_l2(w, size_t(scales) * 2 + r0 * NB * 2, rows * NB * 2, lane, 32);
              } else {  // the high bits and the scales: HB and 2 bytes a chunk (Q6_K's d, NC / 4, left out)
                prefetch_l2(w, k_high + r0 * NC * HB, rows * NC * HB, lane, 32);
                prefetch_l2(w, k_scales + r0 * NC * SB, rows * NC * SB, lane, 32);
              }
            }
          }
        }
#endif
        // The includer's code between the issue of the first weights and the first read of X
        // (seam.metal: the wait for X to be written).
        GEMV_BEFORE_X
      }
#endif
      const uint cb0 = ck * (XCHUNK / 32);
#define X_STORE(m, e, packed)                                                                  \
  {                                                                                            \
    const uint at = ((m) * UNITS + ((e) % VALS) / 8) * XC + (e) / VALS;                       \
    x_tile[at] = uint4{packed[0], packed[1], packed[2], packed[3]};                            \
    x_tile[at + XC] = uint4{packed[4], packed[5], packed[6], packed[7]};                       \
  }
#ifdef GEMV_X_CODES
#include "gemv/x_codes.metal"
#else
#define X_RMS_LATE rms_late
#include "gemv/x_stage.metal"
#undef X_RMS_LATE
#endif
#undef X_STORE
    }
    // 3. The dot products: 16-byte words of X' shared by the RR rows.
    LATHE_UNROLL
    for (uint p = 0; p < uint(PR); ++p) {
      const uint c = lane + 32 * (pass + p);
      if (pass + p >= CPL || c >= cn) continue;
      const uint blk = c * RV / 32;  // the block within the X' chunk
      uint xw[M][RUNITS * 4];
      float dx[M];
      int offset[M];
      for (uint m = 0; m < uint(M); ++m) {
        LATHE_UNROLL
        for (uint u = 0; u < RUNITS; ++u) {
          // values v0 .. v0 + 7 of the X' chunk: staged chunk v0 / VALS, its word (v0 % VALS) / 8
          const uint v0 = c * RV + 8 * u;
          const uint4 v = x_tile[(m * UNITS + (v0 % VALS) / 8) * XC + v0 / VALS];
          xw[m][4 * u] = v.x, xw[m][4 * u + 1] = v.y, xw[m][4 * u + 2] = v.z, xw[m][4 * u + 3] = v.w;
        }
        dx[m] = x_scale[m * (XCHUNK / 32) + blk];
        // Q4_0 takes 8 off each level, Q4_K/Q5_K a min per chunk: both by the block's sum of X'
        offset[m] = QR == 0 ? 8 * x_sum[m * (XCHUNK / 32) + blk]
                            : KQUANT && QR != 4 && !IQ4 ? x_sum[m * (XCHUNK / 32) + blk] : 0;
      }
      LATHE_UNROLL
      for (uint r = 0; r < uint(RR); ++r) {
        const uint qw[4] = {q[r][p].x, q[r][p].y, q[r][p].z, q[r][p].w};
        for (uint m = 0; m < uint(M); ++m) {
          // Two chains of dot products (a long one waits on each step's latency).
          int lo_dot = 0, hi_dot = 0;
          LATHE_UNROLL
          for (uint t = 0; t < 4; ++t) {
            if (QR != 1) {  // word t: values 4t.. (low nibbles) and 16 + 4t.. (high nibbles)
              uint lo = qw[t] & 0x0f0f0f0fu, hi = (qw[t] >> 4) & 0x0f0f0f0fu;
              if (IQ4) {  // each nibble's int8 level
                const uint2 levels = iq4_levels(qw[t]);
                lo = levels.x;
                hi = levels.y;
              } else if (FIFTH) {  // the fifth bits, one a byte
                lo |= ((hb[r][p][0] >> t) & 0x01010101u) << 4;
                hi |= ((hb[r][p][0] >> (4 + t)) & 0x01010101u) << 4;
              } else if (QR == 4) {  // bits 4-5, then level - 32 as int8 in each byte (no borrows:
                                        // level + 0x60 < 0x100, and the xor flips it to two's complement)
                lo |= ((hb[r][p][0] >> (2 * t)) & 0x03030303u) << 4;
                hi |= ((hb[r][p][HB > 4 ? 1 : 0] >> (2 * t)) & 0x03030303u) << 4;
                lo = (lo + 0x60606060u) ^ 0x80808080u;
                hi = (hi + 0x60606060u) ^ 0x80808080u;
              }
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
          if (QR == 4) {  // a scale for each half of the chunk
            acc[r][m] = fma(dx[m], fma(dw[r][p], float(lo_dot), dk[r][p] * float(hi_dot)), acc[r][m]);
          } else if (KQUANT) {  // d * sc * (levels . X') - dmin * m * (sum of X') (legacy: d, offset)
            acc[r][m] = fma(dx[m], fma(dw[r][p], float(lo_dot + hi_dot), -dk[r][p] * float(offset[m])), acc[r][m]);
          } else {
            acc[r][m] = fma(dw[r][p] * dx[m], float(lo_dot + hi_dot - offset[m]), acc[r][m]);
          }
        }
      }
    }
  }
  if (ck == CHUNKS - 1) {  // the row group's last X' chunk: its rows are done
    float total[RR][M];
    for (uint r = 0; r < uint(RR); ++r) {
      for (uint m = 0; m < uint(M); ++m) {
        total[r][m] = simd_sum(acc[r][m]);
        acc[r][m] = 0.0f;
      }
    }
#if LATHE_PROLOGUE == 1
    if (rms_late) {  // each row's 1 / RMS, from the staging's sums of squares in scratch
      for (uint m = 0; m < uint(M); ++m) {
        float ss = 0.0f;
        for (uint s = 0; s < uint(NSIMD); ++s) ss += scratch[m * NSIMD + s];
        const float row_scale = rsqrt(ss / float(k) + eps[0]);
        for (uint r = 0; r < uint(RR); ++r) total[r][m] *= row_scale;
      }
    }
#endif
    for (uint r = 0; r < RO; ++r) {
      for (uint m = 0; m < uint(M); ++m) {
        const uint col = col0 + r;
        if (lane != 0 || col >= n_out) continue;
        float v = total[r][m];
        if (SWIGLU_OUT) {
          v = gate_act<LATHE_ACT>(v) * total[SWIGLU_OUT ? r + RO : r][m];
        }
#ifdef GEMV_BIAS
        v += float(GEMV_BIAS[col]);  // the includer's bias row (layer_block's Q/K/V biases)
#endif
#if LATHE_RESIDUAL
        v += float(residual[m * n_out + col]);
#endif
        y[m * y_stride + col] = half(v);
#ifdef GEMV_ON_Y
        GEMV_ON_Y(m, col, half(v))  // the includer's look at each output as written (gemv_v3's argmax)
#endif
      }
    }
#ifdef GEMV_Y_CODES
#include "gemv/y_codes.metal"
#endif
  }
}
