"""docs/METRICS.md names every series /metrics serves, and no other."""
from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from appliance.server.metrics import Metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "METRICS.md"


def test_the_metrics_page_lists_exactly_the_served_series():
    metrics = Metrics("m")
    metrics.set_context(4096)  # (the token histograms exist once the context length is known)
    served = {f.name for f in text_string_to_metric_families(metrics.render({}).decode())}
    # the series the page names, the cluster ingress's (another endpoint's) aside
    documented = {name for name in re.findall(r"`((?:vllm|muxd):[a-z0-9_]+)", DOC.read_text())
                  if not name.startswith("muxd:cluster_")}
    assert served - documented == set(), "served but not in docs/METRICS.md"
    assert documented - served == {"vllm:prompt_tokens_total"}, "in docs/METRICS.md but not served"
