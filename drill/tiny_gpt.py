"""The GPTs the tests, `make chaos` and the benches train (the bundled task, `trainer.tasks.gpt`).

``TASK_ARGS_TOML``: the smallest, one layer, about 17k parameters, a step in milliseconds on one
core, so that every step can be logged and waited on.

``MULTI_RANK_TASK_ARGS_TOML``: what every multi-rank run trains (torchrun, a pool of nodes):
16 layers, 197 tensors in the model and 788 in its state with AdamW's, yet under a megabyte. A
restore between ranks must cost about one copy of the state whatever the number of tensors, and a
one-layer model hid that it did not (pickling each restored tensor, a view into one buffer,
carried the whole buffer: tensors x state bytes; trainer/checkpoint/broadcast.py).
"""
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

#: The multi-rank model's size: what it changes in the table above.
MULTI_RANK_SIZE = {"n_layer": 16, "n_embd": 16}
#: The same table for multi-rank runs: hundreds of tensors.
MULTI_RANK_TASK_ARGS_TOML = TASK_ARGS_TOML.replace(
    "n_layer = 1\n", f"n_layer = {MULTI_RANK_SIZE['n_layer']}\n").replace(
    "n_embd = 32\n", f"n_embd = {MULTI_RANK_SIZE['n_embd']}\n")
