"""Tools for looking inside a run, each a `python -m harness.tools.<name>` command: where a token's
time goes (profile_decode, host_profile, gpu_trace, startup), benchmark cases under Nsight Compute
(profile, ncu_table), the GEMV chain (gemv_chain), and the families' kernel targets read from a
bench run (gemv_report, attention_report)."""
