"""Checkpointing: where a run's state goes, and how it comes back exactly.

This package owns the checkpoint format, the tiers' stores, the checkpointer that writes and
restores across them, the writer lease, the checkpoint key and the read-only reader. It imports
nothing from the loop, the data or the observers above it (``tests/trainer/test_layering.py``).
"""
