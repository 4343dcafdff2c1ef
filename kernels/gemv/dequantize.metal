// GGUF blocks -> fp16 W[N, K], one thread 32 weights, computed in float32 and rounded to fp16 once:
// Q4_0 (QTYPE 0) (q - 8) * d, Q8_0 (QTYPE 1) q * d, a block each; the K-quants (reference/kquant.py)
// a sub-block's worth of a 256-weight super-block each: Q4_K (QTYPE 2) and Q5_K (3) d * sc * q -
// dmin * m (the product and the difference may fuse into one rounding on the GPU: a checked
// fp16 step at most), Q6_K (4) d * scale * (q - 32).
// Q4_1 (6), Q5_0 (7), Q5_1 (8): d q + m, d (q - 16) and d q + m, a block each (legacy_block.metal);
// IQ4_NL (9) a block, IQ4_XS (10) a sub-block: d (d (ls - 32)) times each nibble's level (iq4_block.metal).
// PACKED 1: q is repacked (kernels.gemv.repack: Q4_0/Q8_0 every block's quants, then every scale;
// the K-quants reference/kquant.py's layout, the legacy blocks reference/quant.py's pack_legacy),
// so the prompt path reads the decode loop's one copy of the weights without unpacking it.
// SPLIT 4 (repacked Q4_0/Q8_0 only): four threads a block, each 8 weights: one 8-byte load of
// quants and one 16-byte store, so a SIMD group's stores cover 512 contiguous bytes (SPLIT 1, a
// thread a block, stores 16 bytes at a 64-byte stride, 4 times: 1.3 TB/s on the H100 for the
// 8B's matrices, kernels/attention/NOTES.md).
// Inputs: q (uint8 blocks), dims (int32: N, K). Output: w (half, [N, K]).
const uint n = uint(dims[0]);
const uint nb = uint(dims[1]) / 32;
if (SPLIT == 4) {
  const uint t = thread_position_in_grid.x, blk = t / 4, part = t % 4;
  if (blk >= n * nb) return;
  const float d = float(as_type<half>(load_wide<ushort>(q, n * nb * (QTYPE == 0 ? 8 : 16) + blk)));
  // Q4_0: weights 8p..8p+7 are the low (p < 2) or high nibbles of quant bytes 8(p % 2)..+7;
  // Q8_0: quant bytes 8p..8p+7
  const uint2 eight = load_wide<uint2>(q, QTYPE == 0 ? blk * 2 + part % 2 : blk * 4 + part);
  const uint shift = QTYPE == 0 && part >= 2 ? 4u : 0u;
  uint h[4];
  for (uint j = 0; j < 4; ++j) {
    const uint word = j < 2 ? eight.x : eight.y;
    float v[2];
    for (uint s = 0; s < 2; ++s) {
      const uint byte = (word >> (16 * (j % 2) + 8 * s)) & 0xffu;
      v[s] = QTYPE == 0 ? float(int((byte >> shift) & 15u) - 8) * d : float(int(byte) - int((byte & 128u) << 1)) * d;
    }
    h[j] = as_type<uint>(half2(half(v[0]), half(v[1])));
  }
  store_wide<uint4>(w, t, uint4{h[0], h[1], h[2], h[3]});
  return;
}
const uint blk = thread_position_in_grid.x;
if (blk >= n * nb) return;  // no SIMD functions here: lanes may leave early

float v[32];
if (PACKED) {
  const uint chunks = n * nb;
#define PC_BYTES q
#include "gemv/packed_chunk.metal"
#undef PC_BYTES
} else if (QTYPE >= 9) {
  const uint c = QTYPE == 10 ? blk % 8 : 0u, base = QTYPE == 10 ? blk / 8 * 136u : blk * 18u;
#define IB_BYTES q
#include "gemv/iq4_block.metal"
#undef IB_BYTES
} else if (QTYPE >= 6) {
  const uint base = blk * (QTYPE == 6 ? 20u : QTYPE == 7 ? 22u : 24u);
#define LB_BYTES q
#include "gemv/legacy_block.metal"
#undef LB_BYTES
} else if (QTYPE >= 2) {
  constexpr uint SB = kquant_super_bytes<QTYPE>();
  const uint c = blk % 8, base = blk / 8 * SB;  // this thread's 32 weights: part c of a super-block
#define KQ_BYTES q
#include "gemv/kquant_block.metal"
#undef KQ_BYTES
} else {
  constexpr uint BB = QTYPE == 0 ? 18 : 34;
  constexpr uint QW = (BB - 2) / 2;  // a block's quants in 2-byte words
  // in 2-byte words: a GGUF block is its scale, then its quants
  const uint quants = blk * (BB / 2) + 1;
  const uint scale = blk * (BB / 2);
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
