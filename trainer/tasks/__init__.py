"""Tasks shipped with the trainer (``--task trainer.tasks.gpt:build`` is the default)."""
