"""Greedy generation by re-running the stateless forward (no cache): the oracle for cached decoding.

The implementation is shared by every model family: `models.stateless.greedy_stateless`.
"""

from models.stateless import greedy_stateless

__all__ = ["greedy_stateless"]
