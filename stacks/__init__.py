"""spottrain stacks: experiment files in, one CDK Terrain stack per experiment out.

Importing this package sets the environment defaults every cdktn process here needs: the CLI's
telemetry and version checks try the network (none here), and jsii should run on the Node that
`make setup` puts into the venv rather than whatever older Node is first on PATH.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("CHECKPOINT_DISABLE", "1")
os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "1")
_venv_node = Path(sys.prefix) / "bin" / "node"
if _venv_node.exists():
    os.environ.setdefault("JSII_NODE", str(_venv_node))
