"""The shutdown window, end to end from the synthesized stack: each VM of a stack (the Spot or
standard template, the on-demand fallback's template, a pool's coordinator) runs its startup
script's window section against a metadata server that serves that VM's own metadata; the unit
it writes (with its drop-in) is read as systemd reads it, and the trainer it starts is run with
the unit's environment up to its command line. The unit must stop the trainer inside the window
its provisioning has, and the trainer's budget must end before the unit stops it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from stack_support import Synthesized

from drill.metadata_server import MetadataServer
from drill.service_manager import parse_unit
from stacks.boot import shquote
from trainer import shutdown_window as W
from trainer.cli import parser

pytestmark = pytest.mark.xdist_group("stacks")

PROVISIONING = {"SPOT": "spot", "STANDARD": "standard", "FLEX_START": "flex-start"}


def vms(s: Synthesized) -> list[tuple[str, dict[str, Any], str, str]]:
    """(what, metadata, startup script, provisioning by its scheduling) of every VM kind."""
    found = []
    for key, t in s.json["resource"].get("google_compute_instance_template", {}).items():
        found.append((key, t["metadata"], t["metadata"]["startup-script"],
                      PROVISIONING[t["scheduling"]["provisioning_model"]]))
    for key, vm in s.json["resource"].get("google_compute_instance", {}).items():
        found.append((key, vm["metadata"], vm["metadata_startup_script"],
                      PROVISIONING[vm["scheduling"]["provisioning_model"]]))
    return found


def boot_window(tmp: Path, metadata: dict[str, Any], startup: str) -> dict[str, Any]:
    """Run the startup script from its shutdown window section to its end (the unit) with the
    VM's metadata; files land under `tmp/root`, systemctl does nothing. Then the trainer.sh it
    wrote, with the unit's environment, up to the trainer's command line."""
    section = startup[startup.index("# --- the shutdown window"):]
    root = tmp / "root"
    stubs = f"""
set -euo pipefail
log() {{ :; }}
systemctl() {{ :; }}
install() {{ mkdir -p "{root}${{@: -1}}"; }}
changed=0
write_if_changed() {{ mkdir -p "$(dirname "{root}$1")"; printf '%s\\n' "$3" > "{root}$1"; }}
python={shquote(sys.executable)}
{re.findall(r"^readonly METADATA=.*$", startup, re.M)[0]}
{re.findall(r"^readonly UNIT=.*$", startup, re.M)[0]}
"""
    with MetadataServer(attributes={k: v for k, v in metadata.items() if isinstance(v, str)}) as md:
        env = {**os.environ, "GCE_METADATA_HOST": md.host}
        subprocess.run(["bash", "-c", stubs + section], env=env, check=True, timeout=60)
        unit_file = root / "etc/systemd/system/spottrain.service"
        # parse_unit reads the drop-ins beside the unit, as systemd does.
        unit = parse_unit(unit_file)
        # The trainer.sh the unit runs, with the unit's environment and a python3 that records
        # its command line instead of training.
        bin_dir, argv_file = tmp / "bin", tmp / "argv"
        bin_dir.mkdir()
        (bin_dir / "python3").write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > {argv_file}\nexit 3\n')
        (bin_dir / "python3").chmod(0o755)
        trainer_sh = (root / "etc/spottrain/trainer.sh").read_text()
        trainer_sh = re.sub(r"^cd .*$", f"cd {tmp}", trainer_sh, count=1, flags=re.M)
        (tmp / "trainer.sh").write_text(trainer_sh)
        run_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "GCE_METADATA_HOST": md.host,
                   **unit.environment, "SPOTTRAIN_PYTHON": str(bin_dir / "python3")}
        subprocess.run(["bash", str(tmp / "trainer.sh")], env=run_env, cwd=tmp, timeout=60)
    argv = [a.decode() for a in argv_file.read_bytes().split(b"\0")[:-1]]
    run = argv.index("trainer") + 1  # "-m trainer run ...", after torchrun's flags if any
    return {"stop_timeout_s": unit.timeout_stop_s, "args": parser().parse_args(argv[run:])}


@pytest.mark.parametrize("name, kinds", [
    ("example", {"spot"}),
    ("standard", {"standard"}),
    ("flex-start", {"flex-start"}),
    ("od-fallback", {"spot", "standard"}),
    ("l4-pool", {"spot", "standard"}),
])
def test_every_vm_stops_its_trainer_inside_its_own_window(synthesized, tmp_path, name, kinds):
    s = synthesized[name]
    seen = set()
    shortest = min(W.trainer_budget_s(k) for k in kinds)
    for i, (what, metadata, startup, provisioning) in enumerate(vms(s)):
        got = boot_window(tmp_path / str(i), metadata, startup)
        stop, budget = got["stop_timeout_s"], got["args"].preemption_budget_s
        window = W.window_s(provisioning)
        assert budget + W.MARGIN_S <= stop, (what, budget, stop)
        assert stop + W.UNIT_SLACK_S <= window, (what, stop, window)
        # Today's numbers: the unit waits the window less the slack, the trainer's budget is all
        # the rest but the margin (a pool's trainers: its shortest window's, every notice counts).
        assert stop == window - W.UNIT_SLACK_S, what
        assert budget == (shortest if name == "l4-pool" else window - W.UNIT_SLACK_S - W.MARGIN_S), what
        seen.add(provisioning)
    assert seen == kinds


def test_a_standard_vm_gives_its_trainer_more_than_a_spot_vm(synthesized, tmp_path):
    """The on-demand fallback's VM (standard) waits 115 s for its trainer; its trainer must not
    abandon the bucket upload at a Spot VM's budget."""
    budgets = {}
    for i, (what, metadata, startup, provisioning) in enumerate(vms(synthesized["od-fallback"])):
        budgets[provisioning] = boot_window(tmp_path / str(i), metadata, startup)["args"].preemption_budget_s
    assert budgets == {"spot": W.trainer_budget_s("spot"), "standard": W.trainer_budget_s("standard")}
    assert budgets["standard"] > W.window_s("spot")


def test_the_numbers():
    assert {k: W.window_s(k) for k in ("spot", "standard", "flex-start")} == \
        {"spot": 30, "standard": 120, "flex-start": 30}
    for k in ("spot", "standard", "flex-start"):
        assert W.trainer_budget_s(k) + W.MARGIN_S + W.UNIT_SLACK_S == W.window_s(k)
        assert W.stop_timeout_s(k) + W.UNIT_SLACK_S == W.window_s(k)
    with pytest.raises(ValueError, match="unknown provisioning"):
        W.window_s("preemptible")
