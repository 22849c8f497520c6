"""SLO contract, the `mux` dispatcher, and the planner factory for every policy."""
