"""Prefill-decode multiplexing on one GPU: SM partitions (green contexts) and, later, the executor that runs decode
graphs and layer-range prefills on them concurrently."""
