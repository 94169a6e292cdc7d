"""Placement: what fits where, and which workload goes first (pure)."""
