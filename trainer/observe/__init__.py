"""Watching a run: its events and their sinks.

- ``events``: the typed events the loop emits, each once (their ``kind`` and ``fields`` are the
  goodput ledger's); ``bus``: ``Bus`` hands them to every ``Sink``;
- ``sinks``: the registry of sinks, one module each: ``log`` (the ``event=`` lines), ``ledger``,
  ``tensorboard``, ``jsonl``, ``monitoring`` (Cloud Monitoring's custom metrics), ``trackers``
  (W&B and MLflow, one tracker run across sessions);
- ``progress``: the log format, the step window, the live line; ``ledger``: the goodput ledger;
  ``goodput``: its report; ``tensorboard``: the event-file writer; ``health``: the answer the
  group's health check gets (and the stall it tells); ``timeline``: ``status --plot``;
  ``glance``: the run at a glance for ``status`` (step, steps/s, ETA, whether a VM is up).
"""
