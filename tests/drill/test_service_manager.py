"""The systemd stand-in and its `systemctl` stub: the semantics the boot scripts rely on."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Callable

import pytest

from drill.sandbox import Sandbox
from drill.service_manager import parse_unit
from drill_support import needs_root, script


def test_parse_unit_reads_what_the_scripts_use(tmp_path: Path) -> None:
    path = tmp_path / "x.service"
    path.write_text("""[Unit]
Description=x
[Service]
Type=exec
ExecStartPre=/usr/bin/mountpoint -q /mnt/spottrain
ExecStart=/etc/spottrain/trainer.sh \\
  --flag value
Environment="A=1 2" B=3
PassEnvironment=GCE_METADATA_HOST STORAGE_EMULATOR_HOST
KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec=25
SuccessExitStatus=75
Restart=on-failure
RestartSec=10
RestartPreventExitStatus=2
Nice=5
""")
    u = parse_unit(path)
    assert u.type == "exec" and u.exec_start_pre == ["/usr/bin/mountpoint -q /mnt/spottrain"]
    assert u.exec_start.split() == ["/etc/spottrain/trainer.sh", "--flag", "value"]
    assert u.environment == {"A": "1 2", "B": "3"}
    assert u.pass_environment == ["GCE_METADATA_HOST", "STORAGE_EMULATOR_HOST"]
    assert (u.kill_signal, u.kill_mode, u.timeout_stop_s) == (signal.SIGTERM, "mixed", 25)
    assert (u.success_exit_status, u.restart, u.restart_s, u.restart_prevent) == ({75}, "on-failure", 10, {2})
    assert u.ignored == ["Nice"]


def test_drop_ins_override_the_unit_in_name_order(tmp_path: Path) -> None:
    """systemd reads NAME.service.d/*.conf after the unit: the startup script's window.conf sets
    the trainer unit's TimeoutStopSec and the trainer's budget that way."""
    path = tmp_path / "x.service"
    path.write_text("[Service]\nExecStart=/bin/true\nTimeoutStopSec=90\nEnvironment=A=1\n")
    (tmp_path / "x.service.d").mkdir()
    (tmp_path / "x.service.d" / "window.conf").write_text("[Service]\nTimeoutStopSec=115\nEnvironment=B=2\n")
    (tmp_path / "x.service.d" / "a.conf").write_text("[Service]\nTimeoutStopSec=7\nEnvironment=A=3\n")
    u = parse_unit(path)
    assert u.timeout_stop_s == 115 and u.environment == {"A": "3", "B": "2"}


def test_a_unit_without_exec_start_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.service"
    path.write_text("[Service]\nType=simple\n")
    with pytest.raises(ValueError, match="no ExecStart"):
        parse_unit(path)


UNIT_HELPERS = r"""
unit() {  # unit NAME BODY...: write a unit file
  local name=$1; shift
  printf '%s\n' '[Service]' "$@" > /etc/systemd/system/$name.service
}
wait_for() {  # wait_for FILE: a file the unit writes (generous guard, not a timing assumption)
  for _ in $(seq 1 600); do [[ -e $1 ]] && return 0; sleep 0.1; done
  echo "timed out waiting for $1"; exit 99
}
show() { systemctl show --property="$2" --value "$1"; }
"""


@needs_root
def test_start_stop_with_sigterm_and_exit_status(tmp_path: Path, make_vm: Callable[..., Sandbox]) -> None:
    vm = make_vm()
    rc = vm.run_script(script(tmp_path, UNIT_HELPERS + r"""
unit saver 'ExecStart=/bin/bash -c "trap \"echo got TERM; exit 75\" TERM; touch /run/saver.up; while :; do sleep 0.1; done"' \
  KillMode=mixed SuccessExitStatus=75 TimeoutStopSec=60
systemctl daemon-reload
systemctl start saver.service
wait_for /run/saver.up
systemctl is-active --quiet saver && echo "is-active: yes"
pid=$(show saver MainPID)
systemctl start saver          # already running: a no-op
echo "same pid: $([[ $(show saver MainPID) == "$pid" ]] && echo yes)"
systemctl stop saver
echo "after stop: $(systemctl is-active saver || true) status=$(show saver ExecMainStatus) result=$(show saver Result)"
systemctl stop saver && echo "second stop: ok"
"""))
    j = vm.journal()
    assert rc == 0, vm.tail()
    assert "is-active: yes" in j and "same pid: yes" in j and "got TERM" in j
    assert "after stop: inactive status=75 result=success" in j
    assert "second stop: ok" in j


@needs_root
def test_stop_timeout_then_sigkill(tmp_path: Path, make_vm: Callable[..., Sandbox]) -> None:
    vm = make_vm()
    rc = vm.run_script(script(tmp_path, UNIT_HELPERS + r"""
unit stubborn 'ExecStart=/bin/bash -c "trap \"echo ignoring TERM\" TERM; touch /run/up; while :; do sleep 0.1; done"' \
  TimeoutStopSec=1
systemctl start stubborn
wait_for /run/up
systemctl stop stubborn
echo "after stop: $(systemctl is-active stubborn || true) code=$(show stubborn ExecMainCode) status=$(show stubborn ExecMainStatus)"
"""))
    j = vm.journal()
    assert rc == 0, vm.tail()
    assert "ignoring TERM" in j and "timed out. Killing." in j
    assert f"after stop: inactive code=killed status={int(signal.SIGKILL)}" in j


@needs_root
def test_restart_on_failure_and_restart_prevent_exit_status(tmp_path: Path, make_vm: Callable[..., Sandbox]) -> None:
    vm = make_vm()
    rc = vm.run_script(script(tmp_path, UNIT_HELPERS + r"""
# Fails once, then runs: Restart=on-failure brings it back.
unit flaky 'ExecStart=/bin/bash -c "if [[ ! -e /run/failed-once ]]; then touch /run/failed-once; exit 1; fi; touch /run/flaky.up; exec sleep infinity"' \
  Restart=on-failure RestartSec=0
systemctl start flaky
wait_for /run/flaky.up
echo "flaky: $(systemctl is-active flaky) restarts=$(show flaky NRestarts)"
# Exit 2 is in RestartPreventExitStatus: failed, not restarted.
unit badinput 'ExecStart=/bin/bash -c "touch /run/bad.ran; exit 2"' Restart=on-failure RestartSec=0 RestartPreventExitStatus=2
systemctl start badinput
wait_for /run/bad.ran
for _ in $(seq 1 600); do systemctl is-failed --quiet badinput && break; sleep 0.1; done
echo "badinput: $(systemctl is-active badinput || true) restarts=$(show badinput NRestarts) status=$(show badinput ExecMainStatus)"
# A clean exit is not restarted with on-failure.
unit done 'ExecStart=/bin/bash -c "touch /run/done.ran; exit 0"' Restart=on-failure RestartSec=0
systemctl start done
wait_for /run/done.ran
for _ in $(seq 1 600); do [[ $(show done ActiveState) == inactive ]] && break; sleep 0.1; done
echo "done: $(show done ActiveState) restarts=$(show done NRestarts)"
# ExecStartPre failing fails the start.
unit guarded 'ExecStartPre=/usr/bin/mountpoint -q /mnt/not-mounted' 'ExecStart=/bin/true'
if systemctl start guarded; then echo "guarded: started"; else echo "guarded: refused"; fi
systemctl start nosuchunit || echo "nosuchunit: rc=$?"
"""))
    j = vm.journal()
    assert rc == 0, vm.tail()
    assert "flaky: active restarts=1" in j
    assert "badinput: failed restarts=0 status=2" in j
    assert "done: inactive restarts=0" in j
    assert "guarded: refused" in j
    assert "nosuchunit: rc=5" in j


@needs_root
def test_unit_environment_is_systemds_not_the_callers(tmp_path: Path, make_vm: Callable[..., Sandbox]) -> None:
    vm = make_vm(env={"FROM_MANAGER": "m", "PASSED": "p"}, default_environment={"DEFAULT_ENV": "d"})
    rc = vm.run_script(script(tmp_path, UNIT_HELPERS + r"""
export FROM_CALLER=c
unit envdump 'ExecStart=/bin/bash -c "env > /run/env.txt"' 'Environment=OWN=o' 'PassEnvironment=PASSED'
systemctl start envdump
wait_for /run/env.txt
sort /run/env.txt | grep -E '^(OWN|PASSED|DEFAULT_ENV|FROM_CALLER|FROM_MANAGER|PATH)=' | sed 's/^/env: /'
"""))
    j = vm.journal()
    assert rc == 0, vm.tail()
    assert "env: OWN=o" in j and "env: PASSED=p" in j and "env: DEFAULT_ENV=d" in j
    assert "env: FROM_MANAGER" not in j and "env: FROM_CALLER" not in j
    assert "env: PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in j


@needs_root
def test_soft_power_off_runs_the_shutdown_script_then_stops_units(tmp_path: Path, make_vm: Callable[..., Sandbox]) -> None:
    vm = make_vm()
    startup = script(tmp_path, UNIT_HELPERS + r"""
unit svc 'ExecStart=/bin/bash -c "trap \"echo svc got TERM; exit 0\" TERM; touch /run/svc.up; while :; do sleep 0.1; done"'
systemctl start svc
wait_for /run/svc.up
""", "startup.sh")
    shutdown = script(tmp_path, 'echo "shutdown sees svc $(systemctl is-active svc)"\n', "shutdown.sh")
    vm.boot(startup_script_file=startup, shutdown_script_file=shutdown)
    vm.wait_event(lambda e: e["event"] == "startup-script-exited", 120)
    off = vm.power_off(window=120)
    j = vm.journal()
    assert off["killed"] is False
    assert j.index("shutdown sees svc active") < j.index("svc got TERM") < j.index("Power down")
