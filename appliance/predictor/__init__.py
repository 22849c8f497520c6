"""Latency prediction: the roofline prior, the fitted solo-run model, the contention guard, profile files, and the
simulated executor that advances virtual time with them."""
