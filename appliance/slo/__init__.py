"""SLO contract, the `mux` dispatcher, and the planner factory for every policy (`POLICIES` names them)."""
from appliance.slo.policies import POLICIES

__all__ = ["POLICIES"]
