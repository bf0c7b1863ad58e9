"""`make chaos` (`python -m drill.chaos`): the trainer's promise under the faults a cloud produces,
fault x moment, against the real `python -m trainer run`.

- `faults`: what each fault reproduces, how it is injected, the moments it applies to;
- `rig`: one cell's world (real ext4 and tmpfs disks, the storage emulator behind the fault proxy,
  the fake metadata server, trainer processes read line by line);
- `task`: the GPT task with a data loader that parks the run at chosen steps (the injection points);
- `matrix`: the cells, what each checks, the run of a selection;
- `report`: the markdown table (RELIABILITY.md records one).

See RELIABILITY.md for the promise, the fault model and the last full run.
"""
