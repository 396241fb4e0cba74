"""Aggregation strategies: pure tensor-in / tensor-out classes, one per algorithm, no transport."""

from aggregator.strategies.fed3r import Fed3R

__all__ = ["Fed3R"]
