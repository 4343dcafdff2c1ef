// Quantized GEMV, v2: Y[M, N] = X'[M, K] @ W^T, W in GGUF blocks (Q4_0: QTYPE 0, 18 bytes a
// block; Q8_0: QTYPE 1, 34 bytes; see gemv.metal), fp16 in and out, fp32 arithmetic.
//
// The work is cut in tiles of 64 blocks (2048 values of K). For each tile:
//  1. the whole threadgroup stages X' for the tile in threadgroup memory as floats, with the
//     prologue applied (LATHE_PROLOGUE, set by the prelude: 0 X as given, 1 RMSNorm of X times
//     gamma, 2 silu(gate) * up from one [M, 2K] gate+up input), and each block's offset sum C;
//  2. each SIMD group stores its R rows of the tile, loaded earlier into registers, to its own
//     threadgroup slice (ALIGNED: 16-byte words, the loads of a SIMD group covering each row
//     contiguously; otherwise rows start only 2-byte aligned and are copied in 2-byte words);
//  3. the next tile's weights are loaded into registers (in flight during step 4);
//  4. lane l decodes blocks 2l and 2l+1 (a pair starts on a 4-byte boundary) of each of the R
//     rows from threadgroup memory, reusing its X' values across the R rows.
// A SIMD sum per row and row of X ends it.
//
// Decoding without int-to-float conversions (1/8 rate on NVIDIA): a byte brought to bits 12..19
// of a word, masked and OR-ed into the exponent of 2048.0f (or 128.0f for the bits 16..19) is
// the float 2048 + q_lo, 128 + q_hi (Q4_0) or 2048 + (q ^ 0x80) = 2176 + q (Q8_0), exactly. The
// block's dot product with those is off by C = sum(2056 x_lo) + sum(136 x_hi) (Q4_0) or
// sum(2176 x) (Q8_0), which depends on X alone: staged once per block, it starts the sum.
// The large offsets cost about 9 bits of the fp32 sum inside one block (~1e-4 relative).
//
// Constants: QTYPE, M (rows of X, 1..4), R (rows per SIMD group), NSIMD (SIMD groups per
// threadgroup), ALIGNED (rows start 16-byte aligned: K a multiple of 256).
// Inputs: x, w (bytes), dims (int32: N, K); prologue 1 adds gamma (half, K) and eps (float, 1).
constexpr uint BB = QTYPE == 0 ? 18 : 34;      // bytes a block
constexpr uint TB = 64;                          // blocks a tile: a pair for each lane
constexpr uint PAIR_WORDS = BB / 2;              // 32-bit words of a block pair (9, 17)
constexpr uint QS_WORDS = (BB - 2) / 4;          // 32-bit words of a block's quants (4, 8)
constexpr uint ROW_WORDS = TB * BB / 4;          // a row's tile in 32-bit words
constexpr uint ROW_VECS = ROW_WORDS / 4;         // ... in 16-byte words (72, 136)
constexpr uint XPAD = 68;                        // 64 floats of X' per lane, then 4 of padding:
constexpr uint XROW = (TB / 2) * XPAD;           // lanes' 16-byte reads then hit distinct banks
constexpr uint STAGED = (R * ROW_VECS + 31) / 32;  // 16-byte words a lane loads per tile
constexpr uint NT = NSIMD * 32;

threadgroup uint4 w_tile[NSIMD * R * ROW_VECS];
threadgroup float4 x_tile[M * XROW / 4];
threadgroup float c_tile[M * TB];

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

// Step s stages and computes tile s - 1, and loads tile s in between (its loads are in flight
// while tile s - 1 is computed): one place for each phase, no lambdas (MSL has none).
const uint tiles = (nb + TB - 1) / TB;
auto x_floats = threadgroup_view<float>(x_tile);
uint4 staged[STAGED];  // this SIMD group's R rows of the next tile, as 16-byte words
for (uint step = 0; step <= tiles; ++step) {
  const uint b0 = (step - 1) * TB;  // the tile computed in this step (if step > 0)
  const uint tb = step > 0 ? min(TB, nb - b0) : 0;
  if (step > 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous tile is no longer read

    // 1. X' and the offset sums, half a block (16 values) per item; the trip count is the same
    //    for every lane, so that the two halves of a block can meet in a shuffle.
    const uint items = M * tb * 2;
    for (uint base = 0; base < items; base += NT) {
      const uint i = base + tid;
      float part = 0.0f;
      if (i < items) {
        const uint m = i / (tb * 2);
        const uint e = (i % (tb * 2)) * 16;  // first value of the item within the tile
        const uint k0 = b0 * 32 + e;
        const uint at = m * XROW + e + (e / 64) * (XPAD - 64);
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
          for (uint j = 0; j < 4; ++j) {
            const half2 h = as_type<half2>(gw[j]);
            float a = float(h.x), b = float(h.y);
#if LATHE_PROLOGUE == 1
            const half2 gm = as_type<half2>(sw[j]);
            a = a * inv_rms[m] * float(gm.x);
            b = b * inv_rms[m] * float(gm.y);
#elif LATHE_PROLOGUE == 2
            const half2 uh = as_type<half2>(uw[j]);
            a = a / (1.0f + exp(-a)) * float(uh.x);
            b = b / (1.0f + exp(-b)) * float(uh.y);
#endif
            x_floats[at + q * 8 + 2 * j] = a;
            x_floats[at + q * 8 + 2 * j + 1] = b;
            s += a + b;
          }
        }
        part = s * (QTYPE == 1 ? 2176.0f : (e % 32 == 0 ? 2056.0f : 136.0f));
      }
      part += simd_shuffle_xor(part, 1);
      if (i < items && i % 2 == 0) c_tile[(i / (tb * 2)) * TB + (i % (tb * 2)) / 2] = part;
    }

    // 2. the weights of this SIMD group's rows.
    if (ALIGNED) {
      const uint seg = tb * BB / 16;
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
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // 3. the next tile's weights (rows past N read nothing).
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

  // 4. blocks 2*lane (A) and 2*lane + 1 (B) of every row.
  for (uint half_ = 0; half_ < 2; ++half_) {
    const uint blk = 2 * lane + half_;
    if (blk >= tb) continue;
    float part[R][M];
    float d[R];
    for (uint r = 0; r < uint(R); ++r) {
      const uint word = my_words[r * ROW_WORDS + lane * PAIR_WORDS + half_ * QS_WORDS];
      d[r] = float(as_type<half>(ushort(half_ == 0 ? word & 0xffffu : word >> 16)));
      for (uint m = 0; m < uint(M); ++m) part[r][m] = -c_tile[m * TB + blk];
    }
    const uint x0 = lane * XPAD + half_ * 32;  // this block's X'
    for (uint t = 0; t < QS_WORDS; ++t) {
      float xa[M][4], xb[M][4];  // Q4_0: values 4t.. (low nibbles) and 16 + 4t.. (high)
      for (uint m = 0; m < uint(M); ++m) {
        const float4 a = x_tile[(m * XROW + x0) / 4 + t];
        xa[m][0] = a.x; xa[m][1] = a.y; xa[m][2] = a.z; xa[m][3] = a.w;
        if (QTYPE == 0) {
          const float4 b = x_tile[(m * XROW + x0) / 4 + 4 + t];
          xb[m][0] = b.x; xb[m][1] = b.y; xb[m][2] = b.z; xb[m][3] = b.w;
        }
      }
      for (uint r = 0; r < uint(R); ++r) {
        if (row0 + r >= n) continue;
        const uint at = r * ROW_WORDS + lane * PAIR_WORDS;
        // Block A's quants start 2 bytes into the pair's first word; block B's are aligned.
        const uint q = half_ == 0 ? (my_words[at + t] >> 16) | (my_words[at + t + 1] << 16)
                                  : my_words[at + QS_WORDS + 1 + t];
        const uint byte_at_12[4] = {q << 12, q << 4, q >> 4, q >> 12};
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
