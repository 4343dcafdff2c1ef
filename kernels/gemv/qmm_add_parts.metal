// Y[m, col] of a split qmm: the KS float32 parts of row col (part [KS, M, N]) added in order, then
// qmm's epilogue, act(gate) * up (LATHE_GATED: the up row N / 2 further on) and the residual, in
// float32 before Y's one rounding. Included where m, col, n and n_out are in scope and QMM_Y_AT
// names Y's index (m * n_out + col, as the includer has it), by qmm_reduce.metal (a thread an
// output) and qmm.metal's LATHE_LAST (a row block's last threadgroup), so that both give the same
// bits.
{
  float out_ = 0.0f;
#if LATHE_GATED
  float up_ = 0.0f;
#endif
  for (uint s_ = 0; s_ < uint(KS); ++s_) {
    out_ += part[(s_ * M + m) * n + col];
#if LATHE_GATED
    up_ += part[(s_ * M + m) * n + n_out + col];
#endif
  }
#if LATHE_GATED
  out_ = gate_act<LATHE_ACT>(out_) * up_;
#endif
#if LATHE_RESIDUAL
  out_ += float(residual[QMM_Y_AT]);
#endif
  y[QMM_Y_AT] = half(out_);
}
