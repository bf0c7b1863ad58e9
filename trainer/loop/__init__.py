"""The training loop's parts; ``trainer.train`` drives them.

- ``session``: one session's parts, in order (start-up, the machinery per VM, building the task,
  putting a checkpoint back, the loop's events, closing);
- ``writers``: one trainer per run dir and per job; ``restore``: where every rank continues
  from; ``finish``: the saves and how a session ends (the durability retries, the emergency save);
- ``step``: the built job and one optimizer step; ``state``: what exact resume needs;
  ``precision``, ``parallel`` (DDP, FSDP2), ``evaluation``, ``preemption`` (notices), ``init_from``.
"""
