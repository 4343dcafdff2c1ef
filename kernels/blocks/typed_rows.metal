// One GEMV phase's rows (gemv/v3_rows.metal) in the block type of this layer's matrix. The includer
// defines ROWS_QA, its matrix's type, and ROWS_QB and ROWS_BIT: the type of the layers whose bit
// ROWS_BIT is set in layer_types[layer] (ROWS_QB == ROWS_QA where every layer has one type: no
// branch, no layer_types). llama.cpp's Q4_K_M gives some layers' attn_v and ffn_down Q6_K beside
// Q4_K; both types stage X' alike (v3_tiles.metal). Undefines the three.
#if ROWS_QB != ROWS_QA
if ((uint(layer_types[layer]) >> ROWS_BIT) & 1u) {
  constexpr uint QR = ROWS_QB;
#include "gemv/v3_rows.metal"
} else
#endif
{
  constexpr uint QR = ROWS_QA;
#include "gemv/v3_rows.metal"
}
#undef ROWS_QA
#undef ROWS_QB
#undef ROWS_BIT
