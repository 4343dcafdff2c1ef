// GGUF quantization on the GPU: fp16 W[N, K] -> blocks of 32 (reference/quant.py has the rules),
// one thread a block. The float32 arithmetic is GGML's, step by step: mul_rn / add_rn / div_rn
// keep the compiler from fusing or approximating it, so the bytes equal the reference's.
//   Q4_0 (QTYPE 0): d = (the first value of largest magnitude, signed) / -8,
//                   q = min(15, trunc(v * (1/d) + 8.5)); byte j = q_j | q_{j+16} << 4.
//   Q8_0 (QTYPE 1): d = max |v| / 127, q = sign(t) floor(|t| + 0.5) with t = v * (1/d), as int8.
// Both store d as fp16 first (2 bytes), then the quants. 1/d is 0 for an all-zero block.
// Inputs: w (half), dims (int32: N, K). Output: q (uint8, N * K/32 * BB).
constexpr uint BB = QTYPE == 0 ? 18 : 34;
const uint n = uint(dims[0]);
const uint nb = uint(dims[1]) / 32;
const uint blk = thread_position_in_grid.x;
if (blk >= n * nb) return;  // no SIMD functions here: lanes may leave early

float v[32];
for (uint i = 0; i < 4; ++i) {
  const uint4 word = load_wide<uint4>(w, blk * 4 + i);  // 8 halves
  const uint u[4] = {word.x, word.y, word.z, word.w};
  for (uint j = 0; j < 4; ++j) {
    const half2 h = as_type<half2>(u[j]);
    v[8 * i + 2 * j] = float(h.x);
    v[8 * i + 2 * j + 1] = float(h.y);
  }
}
float d;
if (QTYPE == 0) {
  float amax = 0.0f, extreme = 0.0f;
  for (uint i = 0; i < 32; ++i) {
    if (fabs(v[i]) > amax) {  // strictly greater: the first of equal magnitudes wins
      amax = fabs(v[i]);
      extreme = v[i];
    }
  }
  d = div_rn(extreme, -8.0f);
} else {
  float amax = 0.0f;
  for (uint i = 0; i < 32; ++i) amax = max(amax, fabs(v[i]));
  d = div_rn(amax, 127.0f);
}
const float id = d != 0.0f ? div_rn(1.0f, d) : 0.0f;
const uint out = blk * (BB / 2);  // in 2-byte words: a block starts on an even byte
store_wide<ushort>(q, out, as_type<ushort>(half(d)));
if (QTYPE == 0) {
  uint nib[32];
  for (uint i = 0; i < 32; ++i) nib[i] = min(15u, uint(trunc(add_rn(mul_rn(v[i], id), 8.5f))));
  for (uint j = 0; j < 8; ++j) {  // bytes 2j, 2j+1
    const uint lo = nib[2 * j] | (nib[2 * j + 16] << 4);
    const uint hi = nib[2 * j + 1] | (nib[2 * j + 17] << 4);
    store_wide<ushort>(q, out + 1 + j, ushort(lo | (hi << 8)));
  }
} else {
  uint b[32];
  for (uint i = 0; i < 32; ++i) {
    const float t = mul_rn(v[i], id);
    const float r = floor(add_rn(fabs(t), 0.5f));
    b[i] = uint(int(t < 0.0f ? -r : r)) & 0xffu;
  }
  for (uint j = 0; j < 16; ++j) store_wide<ushort>(q, out + 1 + j, ushort(b[2 * j] | (b[2 * j + 1] << 8)));
}
