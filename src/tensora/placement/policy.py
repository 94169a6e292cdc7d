"""Admission's knobs, one value handed to every pass."""

from __future__ import annotations

from dataclasses import dataclass

from tensora.units import GIB


@dataclass(frozen=True, slots=True)
class Policy:
    """Knobs of admission. ``cpu_param_limit``: endpoints above it never go on CPU.

    ``timer_slack_s``: how late a cycle may notice a fallback timer (a tick and the cycle
    itself). A fallback placement within it of the timer says the policy's wait
    (``unavailable for 10m``), not the policy plus the seconds the loop took to look.
    """

    cpu_param_limit: float = 8.5e9
    cpu_memory_factor: float = 1.2
    cpu_memory_overhead: int = 2 * GIB
    starvation_after_s: float = 300.0
    owner_fairness: bool = True
    timer_slack_s: float = 5.0

    def cpu_memory_needed(self, model_bytes: int | None) -> int:
        """Host memory an endpoint's model needs on a CPU class (weights, KV cache, runtime)."""
        if not model_bytes:
            return 0
        return int(model_bytes * self.cpu_memory_factor) + self.cpu_memory_overhead

