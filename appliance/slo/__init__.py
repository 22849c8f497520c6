"""The SLO contract: its YAML schema (every problem with its line), the per-class targets, and whether a replay kept
it (attainment)."""
