"""`muxd bench`: replay real request traces against any OpenAI-compatible server (or the engine in process) and
report latency, SLO attainment, goodput and capacity, side by side across scheduling policies.
"""
