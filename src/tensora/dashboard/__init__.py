"""Web pages over the control API (at ``/``): workloads, a workload's timeline, create, capacity and usage."""

from tensora.dashboard.pages import install, router

__all__ = ["install", "router"]
