"""``python -m trainer.checkpoint_key fetch ...``: the boot script's command for the checkpoint key,
under the name the startup script runs (a stable contract); the key itself is
``trainer.checkpoint.key``'s."""
from __future__ import annotations

import sys

from trainer.checkpoint.key import main

if __name__ == "__main__":
    sys.exit(main())
