"""The smallest GPT the tests, `make chaos` and the benches train (the bundled task,
`trainer.tasks.gpt`): one layer, about 17k parameters, a step in milliseconds on one core, so
that every step can be logged and waited on."""
from __future__ import annotations

#: The `[task_args]` table of a trainer config file, ending in a newline.
TASK_ARGS_TOML = """\
[task_args]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32
stride = 32
warmup_steps = 5
"""
