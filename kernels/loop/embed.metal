// Embedding lookup: rows tokens[t] of the table, as fp16 out[T, K]. The table is F16 [V, K]
// (QTYPE 5) or GGUF blocks [V, K/32 * BB] (Q4_0: QTYPE 0, Q8_0: QTYPE 1; value (q - 8) d or q d,
// rounded to fp16 once), or K-quant super-blocks [V, K/256 * SB] (Q4_K 2, Q5_K 3, Q6_K 4: the
// values of gemv/kquant_block.metal), or Q4_1 6, Q5_0 7, Q5_1 8 blocks (gemv/legacy_block.metal), or IQ4_NL 9, IQ4_XS 10 (gemv/iq4_block.metal). Thread: 32 values of one token (a block, or a sub-block's
// worth of a super-block).
// A token id outside 0..V-1 (possible when ids come from the device) gives a zero row instead
// of a read out of bounds; ids from the host are checked before the launch.
// Constants: QTYPE. Inputs: table, tokens (int32[T]), dims (int32: T, K, V). Output: out.
const uint k = uint(dims[1]);
const uint nb = k / 32;
const uint gid = thread_position_in_grid.x;
if (gid >= uint(dims[0]) * nb) return;
const uint t = gid / nb, b = gid % nb;
const int id = tokens[t];
float v[32];
if (id < 0 || id >= dims[2]) {
  for (uint i = 0; i < 32; ++i) v[i] = 0.0f;
} else if (QTYPE == 5) {
  for (uint i = 0; i < 4; ++i) {
    const uint4 w = load_wide<uint4>(table, (uint(id) * k + b * 32) / 8 + i);
    store_wide<uint4>(out, (t * k + b * 32) / 8 + i, w);
  }
  return;
} else if (QTYPE >= 9) {  // IQ4_NL, IQ4_XS (gemv/iq4_block.metal)
  const uint c = QTYPE == 10 ? b % 8 : 0u;
  const uint base = QTYPE == 10 ? (uint(id) * (nb / 8) + b / 8) * 136u : (uint(id) * nb + b) * 18u;
#define IB_BYTES table
#include "gemv/iq4_block.metal"
#undef IB_BYTES
} else if (QTYPE >= 6) {  // Q4_1, Q5_0, Q5_1 (gemv/legacy_block.metal)
  const uint base = (uint(id) * nb + b) * (QTYPE == 6 ? 20u : QTYPE == 7 ? 22u : 24u);
#define LB_BYTES table
#include "gemv/legacy_block.metal"
#undef LB_BYTES
} else if (QTYPE >= 2) {
  constexpr uint SB = kquant_super_bytes<QTYPE>();
  const uint c = b % 8, base = (uint(id) * (nb / 8) + b / 8) * SB;
#define KQ_BYTES table
#include "gemv/kquant_block.metal"
#undef KQ_BYTES
} else {
  constexpr uint BB = QTYPE == 0 ? 18 : 34;
  const uint at = (uint(id) * nb + b) * (BB / 2);  // in 2-byte words
  const float d = float(as_type<half>(load_wide<ushort>(table, at)));
  for (uint j = 0; j < (BB - 2) / 2; ++j) {
    const uint two = uint(load_wide<ushort>(table, at + 1 + j));
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
for (uint i = 0; i < 4; ++i) {
  uint h[4];
  for (uint j = 0; j < 4; ++j) h[j] = as_type<uint>(half2(half(v[8 * i + 2 * j]), half(v[8 * i + 2 * j + 1])));
  store_wide<uint4>(out, (t * k + b * 32) / 8 + i, uint4{h[0], h[1], h[2], h[3]});
}
