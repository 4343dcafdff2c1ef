// Quantized GEMV, v2: Y[M, N] = X'[M, K] @ W^T, W in GGUF blocks (Q4_0: QTYPE 0, 18 bytes a
// block; Q8_0: QTYPE 1, 34 bytes; see gemv.metal), fp16 in and out, fp32 arithmetic.
//
// X' (X, or RMSNorm(X) * gamma, or silu(gate) * up: LATHE_PROLOGUE, set by the prelude) is
// staged as fp16 in threadgroup memory once per chunk of XCHUNK values of K (one chunk when it
// fits, which is every M = 1 shape up to K = 16384), with each block's offset sum C (below).
// Then each SIMD group walks its R rows on its own, in tiles of 64 blocks:
//  1. store the tile's weights, loaded earlier into registers, to its own threadgroup slice
//     (ALIGNED: 16-byte words, a SIMD group's loads covering each row contiguously; otherwise
//     rows start only 2-byte aligned and are copied in 2-byte words);
//  2. load the next tile into registers (in flight while 3 runs);
//  3. lane l decodes blocks 2l and 2l+1 of each row (a pair starts on a 4-byte boundary),
//     reusing its X' values across the R rows.
// Only chunk changes synchronize the threadgroup; a SIMD sum per row ends it.
//
// Decoding without int-to-float conversions (quarter rate on NVIDIA): a byte brought to bits
// 12..19 of a word, masked and OR-ed into the exponent of 2048.0f (128.0f for bits 16..19) is
// the float 2048 + q_lo, 128 + q_hi (Q4_0) or 2048 + (q ^ 0x80) = 2176 + q (Q8_0), exactly.
// The block's dot product with those is off by C = sum(2056 x_lo) + sum(136 x_hi) (Q4_0) or
// sum(2176 x) (Q8_0), which depends on X' alone: staged once per block, it starts the sum. The
// large offsets cost about 9 bits of the fp32 sum inside one block (~1e-4 relative).
//
// Constants: QTYPE, M (rows of X, 1..4), R (rows per SIMD group), NSIMD (SIMD groups per
// threadgroup), ALIGNED (K a multiple of 256: rows start 16-byte aligned), XCHUNK (values of K
// staged at once, a multiple of 2048).
// Inputs: x, w (bytes), dims (int32: N, K); prologue 1 adds gamma (half, K) and eps (float, 1).
constexpr uint BB = QTYPE == 0 ? 18 : 34;      // bytes a block
constexpr uint TB = 64;                          // blocks a tile: a pair for each lane
constexpr uint PAIR_WORDS = BB / 2;              // 32-bit words of a block pair (9, 17)
constexpr uint QS_WORDS = (BB - 2) / 4;          // 32-bit words of a block's quants (4, 8)
constexpr uint ROW_WORDS = TB * BB / 4;          // a row's tile in 32-bit words
constexpr uint ROW_VECS = ROW_WORDS / 4;         // ... in 16-byte words (72, 136)
constexpr uint XPAD = 68;                        // 64 halves of X' per lane, then 4 of padding:
constexpr uint XROW = XCHUNK / 64 * XPAD;        // lanes' 8-byte reads then hit distinct banks
constexpr uint STAGED = (R * ROW_VECS + 31) / 32;  // 16-byte words a lane loads per tile
constexpr uint NT = NSIMD * 32;

threadgroup uint4 w_tile[NSIMD * R * ROW_VECS];
threadgroup half4 x_tile[M * XROW / 4];
threadgroup float c_tile[M * XCHUNK / 32];

const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
const uint tid = thread_index_in_threadgroup;
const uint n = uint(dims[0]);
const uint k = uint(dims[1]);
const uint nb = k / 32;
const uint row_bytes = nb * BB;
const uint row0 = (threadgroup_position_in_grid.x * NSIMD + simd) * R;
auto my_vecs = w_tile + simd * R * ROW_VECS;
auto my_words = threadgroup_view<uint>(my_vecs);

#if LATHE_PROLOGUE == 1
// RMSNorm needs the mean square of each whole row of X first.
threadgroup float inv_rms[M];
threadgroup float scratch[NSIMD];
for (uint m = 0; m < uint(M); ++m) {
  float ss = 0.0f;
  for (uint i = tid; i < k / 8; i += NT) {
    const uint4 v = load_wide<uint4>(x + m * k, i);
    const uint u[4] = {v.x, v.y, v.z, v.w};
    for (uint j = 0; j < 4; ++j) {
      const half2 h = as_type<half2>(u[j]);
      ss += float(h.x) * float(h.x) + float(h.y) * float(h.y);
    }
  }
  const float total = threadgroup_sum<NSIMD>(ss, scratch, simd, lane);
  if (tid == 0) inv_rms[m] = rsqrt(total / float(k) + eps[0]);
}
#endif

float acc[R][M];
for (uint r = 0; r < uint(R); ++r) {
  for (uint m = 0; m < uint(M); ++m) acc[r][m] = 0.0f;
}

// Step s handles tile s - 1 and loads tile s in between, so that one place holds each phase
// (MSL has no lambdas) and a tile's loads are in flight while the one before is computed.
const uint tiles = (nb + TB - 1) / TB;
uint4 staged[STAGED];  // this SIMD group's R rows of the next tile, as 16-byte words
for (uint step = 0; step <= tiles; ++step) {
  const uint b0 = (step - 1) * TB;  // first block of the tile handled in this step
  const uint tb = step > 0 ? min(TB, nb - b0) : 0;
  const uint cb0 = b0 / (XCHUNK / 32) * (XCHUNK / 32);  // first block of its X' chunk
  if (step > 0 && b0 == cb0) {
    // A new chunk of X': every SIMD group is done with the last one past this barrier. Items of
    // half a block (16 values); the same trip count for every lane, so that the two halves of
    // a block can meet in a shuffle.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint cnb = min(XCHUNK / 32, nb - cb0);
    const uint items = M * cnb * 2;
    for (uint base = 0; base < items; base += NT) {
      const uint i = base + tid;
      float part = 0.0f;
      if (i < items) {
        const uint m = i / (cnb * 2);
        const uint e = (i % (cnb * 2)) * 16;  // first value of the item within the chunk
        const uint k0 = cb0 * 32 + e;
        const uint at = (m * XROW + e + (e / 64) * (XPAD - 64)) / 4;
#if LATHE_PROLOGUE == 2
        const auto src = x + m * 2 * k;  // gate; up follows K values later
#else
        const auto src = x + m * k;
#endif
        float s = 0.0f;
        for (uint q = 0; q < 2; ++q) {
          const uint4 g = load_wide<uint4>(src, k0 / 8 + q);
          const uint gw[4] = {g.x, g.y, g.z, g.w};
#if LATHE_PROLOGUE == 1
          const uint4 s4 = load_wide<uint4>(gamma, k0 / 8 + q);
          const uint sw[4] = {s4.x, s4.y, s4.z, s4.w};
#elif LATHE_PROLOGUE == 2
          const uint4 u4 = load_wide<uint4>(src + k, k0 / 8 + q);
          const uint uw[4] = {u4.x, u4.y, u4.z, u4.w};
#endif
          half2 out[4];
          for (uint j = 0; j < 4; ++j) {
            out[j] = as_type<half2>(gw[j]);
#if LATHE_PROLOGUE == 1
            const half2 gm = as_type<half2>(sw[j]);
            out[j] = half2(half(float(out[j].x) * inv_rms[m] * float(gm.x)),
                           half(float(out[j].y) * inv_rms[m] * float(gm.y)));
#elif LATHE_PROLOGUE == 2
            const half2 uh = as_type<half2>(uw[j]);
            const float a = float(out[j].x), b = float(out[j].y);
            out[j] = half2(half(a / (1.0f + exp(-a)) * float(uh.x)),
                           half(b / (1.0f + exp(-b)) * float(uh.y)));
#endif
            s += float(out[j].x) + float(out[j].y);  // of the fp16 values the decode will read
          }
          half4 lo, hi;
          lo.xy = out[0]; lo.zw = out[1]; hi.xy = out[2]; hi.zw = out[3];
          x_tile[at + 2 * q] = lo;
          x_tile[at + 2 * q + 1] = hi;
        }
        part = s * (QTYPE == 1 ? 2176.0f : (e % 32 == 0 ? 2056.0f : 136.0f));
      }
      part += simd_shuffle_xor(part, 1);
      if (i < items && i % 2 == 0) c_tile[(i / (cnb * 2)) * (XCHUNK / 32) + (i % (cnb * 2)) / 2] = part;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (step > 0) {
    // 1. this tile's weights into this SIMD group's slice (its lanes finished the last tile).
    simdgroup_barrier(mem_flags::mem_threadgroup);
    if (ALIGNED) {
      const uint seg = tb * BB / 16;
      LATHE_UNROLL
      for (uint p = 0; p < STAGED; ++p) {
        const uint f = lane + 32 * p;
        if (f < R * seg) my_vecs[(f / seg) * ROW_VECS + f % seg] = staged[p];
      }
    } else {
      const uint seg = tb * BB / 2;
      auto my_halfwords = threadgroup_view<ushort>(my_vecs);
      for (uint f = lane; f < R * seg; f += 32) {
        if (row0 + f / seg < n) {
          my_halfwords[(f / seg) * ROW_WORDS * 2 + f % seg] =
              load_wide<ushort>(w, ((row0 + f / seg) * row_bytes + b0 * BB) / 2 + f % seg);
        }
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }

  // 2. the next tile's weights (rows past N read nothing).
  if (ALIGNED && step < tiles) {
    const uint next = step * TB;
    const uint seg = min(TB, nb - next) * BB / 16;
    for (uint p = 0; p < STAGED; ++p) {
      const uint f = lane + 32 * p;
      staged[p] = uint4{0u, 0u, 0u, 0u};
      if (f < R * seg && row0 + f / seg < n) {
        staged[p] = load_wide<uint4>(w, ((row0 + f / seg) * row_bytes + next * BB) / 16 + f % seg);
      }
    }
  }
  if (step == 0) continue;

  // 3. blocks 2*lane (A) and 2*lane + 1 (B) of every row.
  LATHE_UNROLL
  for (uint half_ = 0; half_ < 2; ++half_) {
    const uint blk = 2 * lane + half_;
    if (blk >= tb) continue;
    float part[R][M];
    float d[R];
    for (uint r = 0; r < uint(R); ++r) {
      const uint word = my_words[r * ROW_WORDS + lane * PAIR_WORDS + half_ * QS_WORDS];
      d[r] = float(as_type<half>(ushort(half_ == 0 ? word & 0xffffu : word >> 16)));
      for (uint m = 0; m < uint(M); ++m) part[r][m] = -c_tile[m * (XCHUNK / 32) + b0 - cb0 + blk];
    }
    const uint x0 = (((b0 - cb0) / 2 + lane) * XPAD + half_ * 32) / 4;  // this block's X', as half4s
    LATHE_UNROLL
    for (uint t = 0; t < QS_WORDS; ++t) {
      float xa[M][4], xb[M][4];  // Q4_0: values 4t.. (low nibbles) and 16 + 4t.. (high)
      for (uint m = 0; m < uint(M); ++m) {
        const half4 a = x_tile[m * XROW / 4 + x0 + t];
        xa[m][0] = float(a.xy.x); xa[m][1] = float(a.xy.y);
        xa[m][2] = float(a.zw.x); xa[m][3] = float(a.zw.y);
        if (QTYPE == 0) {
          const half4 b = x_tile[m * XROW / 4 + x0 + 4 + t];
          xb[m][0] = float(b.xy.x); xb[m][1] = float(b.xy.y);
          xb[m][2] = float(b.zw.x); xb[m][3] = float(b.zw.y);
        }
      }
      LATHE_UNROLL
      for (uint r = 0; r < uint(R); ++r) {
        if (row0 + r >= n) continue;
        const uint at = r * ROW_WORDS + lane * PAIR_WORDS;
        // Block A's quants start 2 bytes into the pair's first word; block B's are aligned.
        const uint q = half_ == 0 ? (my_words[at + t] >> 16) | (my_words[at + t + 1] << 16)
                                  : my_words[at + QS_WORDS + 1 + t];
        const uint byte_at_12[4] = {q << 12, q << 4, q >> 4, q >> 12};
        LATHE_UNROLL
        for (uint s = 0; s < 4; ++s) {
          const uint v = byte_at_12[s];
          if (QTYPE == 0) {
            const float lo = as_type<float>((v & 0x0000f000u) | 0x45000000u);  // 2048 + q_lo
            const float hi = as_type<float>((v & 0x000f0000u) | 0x43000000u);  // 128 + q_hi
            for (uint m = 0; m < uint(M); ++m) {
              part[r][m] = fma(lo, xa[m][s], part[r][m]);
              part[r][m] = fma(hi, xb[m][s], part[r][m]);
            }
          } else {
            const float b = as_type<float>(((v & 0x000ff000u) ^ 0x00080000u) | 0x45000000u);
            for (uint m = 0; m < uint(M); ++m) part[r][m] = fma(b, xa[m][s], part[r][m]);
          }
        }
      }
    }
    for (uint r = 0; r < uint(R); ++r) {
      for (uint m = 0; m < uint(M); ++m) acc[r][m] = fma(d[r], part[r][m], acc[r][m]);
    }
  }
}

for (uint r = 0; r < uint(R); ++r) {
  for (uint m = 0; m < uint(M); ++m) {
    const float total = simd_sum(acc[r][m]);
    if (lane == 0 && row0 + r < n) y[m * n + row0 + r] = half(total);
  }
}
