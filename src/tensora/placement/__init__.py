"""Placement: the pure words and decisions of where workloads run (no I/O)."""
