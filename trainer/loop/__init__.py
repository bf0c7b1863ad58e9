"""The training loop's parts: the exact-resume state, mixed precision, evaluation, preemption
notices and ``init_from``; ``trainer.train`` drives them."""
