"""Hand-made latency tables for tests that drive the mux planner on a real engine (CPU or GPU)."""
from __future__ import annotations


class SlowTable:
    """Prefill 10 ms per new token (so each step beside decode advances one layer), decode 45 ms on 32 SMs (80 on 16,
    20 on all), never a mixed step."""

    def prefill_ms(self, items, sms):
        return 10.0 * sum(i.new for i in items)

    def decode_ms(self, load, sms):
        return {16: 80.0, 32: 45.0}.get(sms, 20.0) if load.batch_size else 0.0

    def mixed_ms(self, items, load, sms):
        return 1e6
