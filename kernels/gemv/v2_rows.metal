// One v2 GEMV over the row groups of threadgroup `group` (of dims[2]), included by a kernel
// body inside a scope that names: x, w, dims, y (and residual, gamma, eps as its LATHE_PROLOGUE /
// LATHE_RESIDUAL need them), `group`, and the declarations of v2_tiles.metal. gemv_v2.metal
// runs it once as its own threadgroup; seam.metal runs two GEMVs, each over groups it claims.
const uint n = uint(dims[0]);
const uint k = uint(dims[1]);
const uint nb = k / 32;
const uint row_bytes = nb * BB;
// The row groups (R rows each) of this SIMD group: first, first + stride, ... The host may launch
// fewer threadgroups than row groups (about one wave): each SIMD group then streams its row
// groups one after another, its weight loads running ahead across them, and X' is staged once
// (so only where one chunk of X' holds all of K; otherwise the host launches one threadgroup per
// NSIMD row groups and every SIMD group has one). A SIMD group past N still takes one (empty)
// row group: it meets the threadgroup barriers of the staging like the others.
const uint n_groups = (n + R - 1) / R;
const uint stride = uint(dims[2]) * NSIMD;
const uint first = group * NSIMD + simd;
const uint mine = first < n_groups ? (n_groups - first + stride - 1) / stride : 1;
const uint tiles = (nb + TB - 1) / TB;
const uint items = mine * tiles;  // (row group, tile) pairs, a row group's tiles in order
const bool one_chunk = nb <= XCHUNK / 32;

float acc[R][M];
for (uint r = 0; r < uint(R); ++r) {
  for (uint m = 0; m < uint(M); ++m) acc[r][m] = 0.0f;
}

// Step s handles item s - 1 and loads later items in between, so that one place holds each
// phase (MSL has no lambdas) and weights are in flight while the item before is computed.
// Step 0 only loads: the first weights are on their way before the prologue reads X.
uint4 staged[STAGED] = {};  // SLOTS 0: this SIMD group's R rows of the next tile, as 16-byte words
// Word p of a lane's share of a full tile is word lane + 32p of the SIMD group's slice (rows
// ROW_VECS words apart): row `word_row` of the row group (R: none), at `word_at` 16-byte words
// from the group's first row (worked out once: divisions in the loop cost more than the decode).
uint word_row[STAGED], word_at[STAGED];
for (uint p = 0; p < STAGED; ++p) {
  const uint f = lane + 32 * p;
  word_row[p] = f < R * ROW_VECS ? f / ROW_VECS : R;
  word_at[p] = (f / ROW_VECS) * (row_bytes / 16) + f % ROW_VECS;
}
for (uint step = 0; step <= items; ++step) {
  // The item handled in this step: row group hj of this SIMD group (rows row0..), tile from b0.
  const uint h = step - 1;
  const uint hj = step > 0 ? h / tiles : 0;
  const uint b0 = step > 0 ? (h - hj * tiles) * TB : 0;
  const uint row0 = (first + hj * stride) * R;
  const uint tb = step > 0 ? min(TB, nb - b0) : 0;
  const uint cb0 = b0 / (XCHUNK / 32) * (XCHUNK / 32);  // first block of its X' chunk
  if (step > 0 && b0 == cb0 && (hj == 0 || !one_chunk)) {
    // A new chunk of X' (x_stage.metal), in the v2 layout: 64 values a lane, then XPAD - 64 of
    // padding, so that lanes' 8-byte reads hit distinct banks.
#define X_STORE(m, e, packed)                                                                  \
  for (uint j = 0; j < 4; ++j)                                                                 \
    x_tile[((m) * XROW + (e) + ((e) / 64) * (XPAD - 64)) / 4 + j] = uint2{packed[2 * j], packed[2 * j + 1]}
#include "gemv/x_stage.metal"
#undef X_STORE
  }

  if (SLOTS < 2 && step > 0) {
    // 1. this item's weights into this SIMD group's slice (its lanes finished the last one).
    simdgroup_barrier(mem_flags::mem_threadgroup);
    if (ALIGNED && tb == TB) {
      LATHE_UNROLL
      for (uint p = 0; p < STAGED; ++p) {
        if (lane + 32 * p < R * ROW_VECS) my_vecs[lane + 32 * p] = staged[p];
      }
    } else if (ALIGNED) {  // the last tile of a row, shorter
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
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }

  // 2. the weights of later items (rows past N read nothing). SLOTS 0: item `step` into
  // registers. SLOTS > 1: copies straight into threadgroup memory. Step 0 fills every slot
  // (items 0 .. SLOTS - 1, all in flight before the prologue: a SIMD group with two items, as
  // in the 4096-wide projections, has all its weights on the way at once); step 1 issues none;
  // step s > 1 issues item s + SLOTS - 2 into the slot of item s - 2, which this SIMD group
  // finished at step s - 1. So SLOTS - 1 items are in flight while one is computed. One group
  // of copies an item (empty past the last): waiting for all but the newest SLOTS - 1 groups
  // means item s - 1 landed.
  if (SLOTS > 1) simdgroup_barrier(mem_flags::mem_threadgroup);
  const uint last = SLOTS < 2 ? step : step == 0 ? SLOTS - 1 : step + SLOTS - 2;
  const uint first_it = SLOTS < 2 ? step : step == 0 ? 0 : max(step + SLOTS - 2, uint(SLOTS));
  for (uint it = first_it; ALIGNED && it <= last; ++it) {
    if (it < items) {
      const uint jj = it / tiles;
      const uint next = (it - jj * tiles) * TB;  // the tile's first block
      const uint r0 = (first + jj * stride) * R;
      const uint base = r0 * (row_bytes / 16) + next * BB / 16;
      auto slot = my_vecs + (it % TILE_SLOTS) * R * ROW_VECS;
      if (nb - next >= TB) {
        LATHE_UNROLL
        for (uint p = 0; p < STAGED; ++p) {
          const bool live = word_row[p] < R && r0 + word_row[p] < n;
          if (SLOTS > 1) {
            if (live) async_copy_wide(slot + lane + 32 * p, w, base + word_at[p]);
          } else {
            staged[p] = live ? load_wide<uint4>(w, base + word_at[p]) : uint4{0u, 0u, 0u, 0u};
          }
        }
      } else {  // the last tile of a row, shorter
        const uint seg = (nb - next) * BB / 16;
        for (uint p = 0; p < STAGED; ++p) {
          const uint f = lane + 32 * p;
          const bool live = f < R * seg && r0 + f / seg < n;
          const uint from = base + (f / seg) * (row_bytes / 16) + f % seg;
          if (SLOTS > 1) {
            if (live) async_copy_wide(slot + (f / seg) * ROW_VECS + f % seg, w, from);
          } else {
            staged[p] = live ? load_wide<uint4>(w, from) : uint4{0u, 0u, 0u, 0u};
          }
        }
      }
    }
    if (SLOTS > 1) async_commit();
  }
  if (SLOTS > 1 && step > 0) {
    async_wait<(SLOTS > 1 ? SLOTS - 1 : 0)>();
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (step == 0) {
#ifdef GEMV_BEFORE_X
    // The includer's code between the issue of the first weights and the first read of X
    // (seam.metal: the wait for X to be written).
    GEMV_BEFORE_X
#endif
    continue;
  }

  // 3. blocks 2*lane (A) and 2*lane + 1 (B) of every row.
  auto my_words = threadgroup_view<uint>(my_vecs + (h % TILE_SLOTS) * R * ROW_VECS);
  LATHE_UNROLL
  for (uint half_ = 0; half_ < 2; ++half_) {
    const uint blk = 2 * lane + half_;
    if (blk >= tb) continue;
    int dot[R][M];
    float d[R];
    for (uint r = 0; r < uint(R); ++r) {
      const uint word = my_words[r * ROW_WORDS + lane * PAIR_WORDS + half_ * QS_WORDS];
      d[r] = float(as_type<half>(ushort(half_ == 0 ? word & 0xffffu : word >> 16)));
      for (uint m = 0; m < uint(M); ++m) dot[r][m] = 0;
    }
    const uint x0 = (((b0 - cb0) / 2 + lane) * XPAD + half_ * 32) / 4;  // this block's X', in uint2s
    LATHE_UNROLL
    for (uint t = 0; t < QS_WORDS; ++t) {
      uint2 xa[M], xb[M];  // Q4_0: values 4t.. (low nibbles) and 16 + 4t.. (high nibbles)
      for (uint m = 0; m < uint(M); ++m) {
        xa[m] = x_tile[m * XROW / 4 + x0 + t];
        if (QTYPE == 0) xb[m] = x_tile[m * XROW / 4 + x0 + 4 + t];
      }
      LATHE_UNROLL
      for (uint r = 0; r < uint(R); ++r) {
        if (row0 + r >= n) continue;
        const uint at = r * ROW_WORDS + lane * PAIR_WORDS;
        // Block A's quants start 2 bytes into the pair's first word; block B's are aligned.
        const uint q = half_ == 0 ? (my_words[at + t] >> 16) | (my_words[at + t + 1] << 16)
                                  : my_words[at + QS_WORDS + 1 + t];
        if (QTYPE == 0) {
          const uint lo = q & 0x0f0f0f0fu, hi = (q >> 4) & 0x0f0f0f0fu;
          for (uint m = 0; m < uint(M); ++m) {
            dot[r][m] = dot2_lo(xa[m].x, lo, dot[r][m]);
            dot[r][m] = dot2_hi(xa[m].y, lo, dot[r][m]);
            dot[r][m] = dot2_lo(xb[m].x, hi, dot[r][m]);
            dot[r][m] = dot2_hi(xb[m].y, hi, dot[r][m]);
          }
        } else {
          for (uint m = 0; m < uint(M); ++m) {
            dot[r][m] = dot2_lo(xa[m].x, q, dot[r][m]);
            dot[r][m] = dot2_hi(xa[m].y, q, dot[r][m]);
          }
        }
      }
    }
    for (uint m = 0; m < uint(M); ++m) {
      const uint at = m * (XCHUNK / 32) + b0 - cb0 + blk;
      const float dx = x_scale[at];
      const int offset = QTYPE == 0 ? 8 * x_sum[at] : 0;
      for (uint r = 0; r < uint(R); ++r) acc[r][m] = fma(d[r] * dx, float(dot[r][m] - offset), acc[r][m]);
    }
  }

  if (b0 + tb == nb) {  // the row group's last tile: its rows are done
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
