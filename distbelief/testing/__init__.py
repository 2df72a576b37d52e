"""Test and benchmark tooling: fault injection and straggler emulation (not user settings; see faults.py)."""

from distbelief.testing.faults import FaultInjector, Faults

__all__ = ["FaultInjector", "Faults"]
