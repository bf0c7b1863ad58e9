"""spottrain trainer: a PyTorch training loop that survives Spot preemption.

It resumes exactly (weights, optimizer, scheduler, grad scaler, RNG, data position) from the newest
valid checkpoint across three tiers, saves asynchronously, saves at once on a preemption notice,
answers a TCP health check and keeps a goodput ledger. Entry point: ``python -m trainer``.
"""
from __future__ import annotations

# Exit codes of `python -m trainer run` (a stable contract, documented in docs/concepts.md#exit-statuses).
EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: a checkpoint tier stayed unreadable; nothing trained; run again to retry
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by preemption after a successful save; run again to resume
#: EX_IOERR: trained to the final step (or the pause's) but its checkpoint could not be made durable on
#: every durable tier within ``durable_timeout_s``; run again: the re-run writes the missing copies.
EXIT_NOT_DURABLE = 74
#: EX_NOPERM: paused at the spend cap (``max_usd``) after its checkpoint was made durable on every
#: tier; run again with a higher cap to continue.
EXIT_SPEND_CAP = 77
