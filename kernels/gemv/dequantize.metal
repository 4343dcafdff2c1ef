// GGUF blocks -> fp16 W[N, K], one thread 32 weights, computed in float32 and rounded to fp16 once:
// Q4_0 (QTYPE 0) (q - 8) * d, Q8_0 (QTYPE 1) q * d, a block each; the K-quants (reference/kquant.py)
// a sub-block's worth of a 256-weight super-block each: Q4_K (QTYPE 2) and Q5_K (3) d * sc * q -
// dmin * m (the product and the difference may fuse into one rounding on the GPU: a checked
// fp16 step at most), Q6_K (4) d * scale * (q - 32).
// PACKED 1 (Q4_0, Q8_0): q is repacked (kernels.gemv.repack: every block's quants, then every
// scale), so the prompt path reads the decode loop's one copy of the weights without unpacking it.
// Inputs: q (uint8 blocks), dims (int32: N, K). Output: w (half, [N, K]).
const uint n = uint(dims[0]);
const uint nb = uint(dims[1]) / 32;
const uint blk = thread_position_in_grid.x;
if (blk >= n * nb) return;  // no SIMD functions here: lanes may leave early

float v[32];
if (QTYPE >= 2) {
  constexpr uint SB = QTYPE == 2 ? 144 : QTYPE == 3 ? 176 : 210;  // bytes a super-block
  const uint c = blk % 8, base = blk / 8 * SB;  // this thread's 32 weights: part c of a super-block
  if (QTYPE == 4) {
    // ql[128] low nibbles, qh[64] high bit pairs, int8 scales[16] (one a 16 weights), fp16 d; the
    // 256 weights as two halves of 128, each four parts of 32 over 64 ql bytes and 32 qh bytes
    const uint half_at = c / 4, part = c % 4;
    const float d = float(as_type<half>(ushort(uint(q[base + 208]) | (uint(q[base + 209]) << 8))));
    for (uint l = 0; l < 32; ++l) {
      const uint low = uint(q[base + half_at * 64 + (part & 1u) * 32 + l]);
      const uint high = (uint(q[base + 128 + half_at * 32 + l]) >> (2 * part)) & 3u;
      const uint s = uint(q[base + 192 + half_at * 8 + part * 2 + l / 16]);
      const float scale = float(int(s) - int((s & 128u) << 1));
      const uint level = (part >= 2 ? low >> 4 : low & 15u) | (high << 4);
      v[l] = d * scale * float(int(level) - 32);
    }
  } else {
    // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (GGML's get_scale_min_k4), Q5_K's 32
    // bytes of fifth bits (bit c of byte l), then the nibbles: in each 64 weights, byte l holds
    // weight l low and weight l + 32 high
    const float d = float(as_type<half>(ushort(uint(q[base]) | (uint(q[base + 1]) << 8))));
    const float dmin = float(as_type<half>(ushort(uint(q[base + 2]) | (uint(q[base + 3]) << 8))));
    const uint at = base + 4;
    const uint sc = c < 4 ? uint(q[at + c]) & 63u : (uint(q[at + c + 4]) & 15u) | ((uint(q[at + c - 4]) >> 6) << 4);
    const uint mn = c < 4 ? uint(q[at + c + 4]) & 63u : (uint(q[at + c + 4]) >> 4) | ((uint(q[at + c]) >> 6) << 4);
    const float scale = d * float(sc), offset = dmin * float(mn);
    const uint quants = base + (QTYPE == 3 ? 48 : 16) + c / 2 * 32;
    for (uint l = 0; l < 32; ++l) {
      uint level = (uint(q[quants + l]) >> (4 * (c % 2))) & 15u;
      if (QTYPE == 3) level |= ((uint(q[base + 16 + l]) >> c) & 1u) << 4;
      v[l] = scale * float(level) - offset;
    }
  }
} else {
  constexpr uint BB = QTYPE == 0 ? 18 : 34;
  constexpr uint QW = (BB - 2) / 2;  // a block's quants in 2-byte words
  // in 2-byte words: a GGUF block is its scale, then its quants
  const uint quants = PACKED ? blk * QW : blk * (BB / 2) + 1;
  const uint scale = PACKED ? n * nb * QW + blk : blk * (BB / 2);
  const float d = float(as_type<half>(load_wide<ushort>(q, scale)));
  for (uint j = 0; j < QW; ++j) {
    const uint two = uint(load_wide<ushort>(q, quants + j));  // bytes 2j, 2j+1
    for (uint s = 0; s < 2; ++s) {
      const uint byte = (two >> (8 * s)) & 0xffu;
      if (QTYPE == 0) {
        v[2 * j + s] = float(int(byte & 15u) - 8) * d;
        v[2 * j + s + 16] = float(int(byte >> 4) - 8) * d;
      } else {
        v[2 * j + s] = float(int(byte) - int((byte & 128u) << 1)) * d;
      }
    }
  }
}
for (uint i = 0; i < 4; ++i) {  // 64 bytes out as four 16-byte words
  uint h[4];
  for (uint j = 0; j < 4; ++j) {
    h[j] = as_type<uint>(half2(half(v[8 * i + 2 * j]), half(v[8 * i + 2 * j + 1])));
  }
  store_wide<uint4>(w, blk * 4 + i, uint4{h[0], h[1], h[2], h[3]});
}
