"""The checkpoint key's secret name, `<experiment>-checkpoint-key`: what the stack creates
(`stacks.checkpoint_key`), the VM's boot fetches (`stacks.boot`) and `deploy` looks for
(`stacks.deploy`).

Kept apart from the construct so that reading and checking an experiment imports no cdktn: the
jsii runtime it starts costs seconds, and a bad file's one-line error should not wait for it.
"""

from __future__ import annotations


def secret_id(experiment: str) -> str:
    return f"{experiment}-checkpoint-key"


def secret_name(project: str, experiment: str) -> str:
    """The secret's resource name, as the VM's boot fetches it (`projects/P/secrets/S`)."""
    return f"projects/{project}/secrets/{secret_id(experiment)}"
