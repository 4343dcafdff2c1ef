// GGUF blocks -> fp16 W[N, K], one thread a block of 32: Q4_0 (QTYPE 0) (q - 8) * d,
// Q8_0 (QTYPE 1) q * d, computed in float32 and rounded to fp16 once.
// PACKED 1: q is repacked (kernels.gemv.repack: every block's quants, then every scale), so the
// prompt path reads the decode loop's one copy of the weights without unpacking it first.
// Inputs: q (uint8 blocks), dims (int32: N, K). Output: w (half, [N, K]).
constexpr uint BB = QTYPE == 0 ? 18 : 34;
constexpr uint QW = (BB - 2) / 2;  // a block's quants in 2-byte words
const uint n = uint(dims[0]);
const uint nb = uint(dims[1]) / 32;
const uint blk = thread_position_in_grid.x;
if (blk >= n * nb) return;  // no SIMD functions here: lanes may leave early

// in 2-byte words: a GGUF block is its scale, then its quants
const uint quants = PACKED ? blk * QW : blk * (BB / 2) + 1;
const uint scale = PACKED ? n * nb * QW + blk : blk * (BB / 2);
const float d = float(as_type<half>(load_wide<ushort>(q, scale)));
float v[32];
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
for (uint i = 0; i < 4; ++i) {  // 64 bytes out as four 16-byte words
  uint h[4];
  for (uint j = 0; j < 4; ++j) {
    h[j] = as_type<uint>(half2(half(v[8 * i + 2 * j]), half(v[8 * i + 2 * j + 1])));
  }
  store_wide<uint4>(w, blk * 4 + i, uint4{h[0], h[1], h[2], h[3]});
}
