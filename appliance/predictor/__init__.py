"""Latency models: the roofline prior, the fitted solo-run model, the contention guard and split slowdown, the
decode and prefill kernel plans, the GEMM table, and the profile file they are loaded from."""
