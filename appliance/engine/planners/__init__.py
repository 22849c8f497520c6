"""Scheduling policies: each planner decides every step (`base.py` holds the interface), `registry.py` builds one
by name."""
