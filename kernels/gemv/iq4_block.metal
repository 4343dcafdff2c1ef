// The 32 weights of one GGUF IQ4_NL block (QTYPE 9: 18 bytes, fp16 d then 16 of nibbles) or of
// sub-block c (0..7) of an IQ4_XS super-block (10: 136 bytes, fp16 d, scales_h (2 bytes),
// scales_l (4), then 16 bytes of nibbles a sub-block) into v[32], in float32 as reference/iquant.py
// (GGML's dequantize_row_iq4_*) computes them: d * level, or d * (ls - 32) * level, each nibble's
// level from lathe.h's iq4_levels. In the nibbles, byte l holds weight l low and l + 16 high.
// Shared by dequantize.metal and the embedding (loop/embed.metal). The scope names: IB_BYTES (the
// blocks, bytes), base (the block's or super-block's first byte), c (IQ4_XS), v and QTYPE.
{
  const float d = float(as_type<half>(ushort(uint(IB_BYTES[base]) | (uint(IB_BYTES[base + 1]) << 8))));
  float dl = d;
  uint quants = base + 2;
  if (QTYPE == 10) {
    const uint scales_h = uint(IB_BYTES[base + 2]) | (uint(IB_BYTES[base + 3]) << 8);
    const uint ls = ((uint(IB_BYTES[base + 4 + c / 2]) >> (4 * (c % 2))) & 15u) | (((scales_h >> (2 * c)) & 3u) << 4);
    dl = d * float(int(ls) - 32);
    quants = base + 8 + 16 * c;
  }
  for (uint l = 0; l < 16; ++l) {
    const uint byte = uint(IB_BYTES[quants + l]);
    const uint both = iq4_levels((byte & 15u) | ((byte >> 4) << 8)).x;  // bytes 0, 1: the two levels
    v[l] = dl * float(int(char(both & 255u)));
    v[l + 16] = dl * float(int(char((both >> 8) & 255u)));
  }
}
