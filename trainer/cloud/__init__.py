"""What runs beside the trainer on Google Cloud, standard library only (no torch, no client
libraries: the VM's boot scripts, the control job and a laptop's `make` targets run these too).

- ``gce``: the REST calls (metadata server, Compute, Cloud Run, Secret Manager), through
  ``trainer.retry``;
- ``scale``: the VM's side of stopping (a stop marker, starting the control job, the flex-start
  successor request); ``control``: the control job (a Cloud Run job with its own account) that
  resizes the groups, stops a pool's coordinator and runs the on-demand fallback's check in
  ``capacity``;
- ``vm_info``: where this session runs (zone, provisioning model, boot time), for the ledger's
  ``placement`` event;
- ``log_shipper``: the VM's journal into Cloud Logging (copied to the VM verbatim: it imports
  nothing of the trainer); ``logs``: ``python -m trainer logs``, reading it back.
"""
