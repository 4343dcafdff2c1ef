// GGUF blocks -> fp16 W[N, K], one thread a block of 32: Q4_0 (QTYPE 0) (q - 8) * d,
// Q8_0 (QTYPE 1) q * d, computed in float32 and rounded to fp16 once.
// Inputs: q (uint8 blocks), dims (int32: N, K). Output: w (half, [N, K]).
constexpr uint BB = QTYPE == 0 ? 18 : 34;
const uint n = uint(dims[0]);
const uint nb = uint(dims[1]) / 32;
const uint blk = thread_position_in_grid.x;
if (blk >= n * nb) return;  // no SIMD functions here: lanes may leave early

const uint at = blk * (BB / 2);  // in 2-byte words
const float d = float(as_type<half>(load_wide<ushort>(q, at)));
float v[32];
for (uint j = 0; j < (BB - 2) / 2; ++j) {
  const uint two = uint(load_wide<ushort>(q, at + 1 + j));  // bytes 2j, 2j+1
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
