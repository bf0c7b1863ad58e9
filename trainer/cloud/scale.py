"""What a training VM may do about its own job: stop paying, and ask for its successor.

The VM holds no Compute permission (docs/security.md): it writes into its bucket and starts its
experiment's control job (`trainer.cloud.control`, a Cloud Run job with an identity of its own), which
changes the groups and reports back in the bucket.

`python -m trainer.cloud.scale stop REASON [--detail TEXT]` (REASON: `finished` or `bad-input`) is the
one path a job that needs no VM takes, for a run that finished and for one that cannot continue
without a human (the exit-2 path calls it through `/etc/spottrain/stop_paying.sh REASON`):

1. It checks that scaling to zero loses nothing: the group deletes the VM *and its checkpoint
   disk*. `finished` needs the final checkpoint (`step-<steps>`) in the bucket; `bad-input` needs
   the bucket to hold a checkpoint at least as new as the newest on this VM's disk. A checkpoint in
   the bucket counts only when it is authentic and complete: its manifest's HMAC verifies under the
   run's checkpoint key (`checkpoint_key_file`, on the VM; `trainer.manifest_auth`, as the trainer
   judges it), it is signed for this run (not another run's copied in), its step is its folder's, and every file it lists is there with the listed size. A
   name is never enough: whoever can write the bucket can plant one. Otherwise it refuses (exit 3):
   the VM stays, idle and paying, and the log says why.
2. It writes a stop marker into the bucket: `<prefix>/stop/finished-steps-<steps>.json` or
   `<prefix>/stop/bad-input-<digest>.json` (digest: the first 16 hex of the startup script's
   sha256, so a fixed experiment, which renders another script, is a new start). The marker is a
   record signed with the checkpoint key (`trainer.cloud.stop_marker`), bound to the run, its own
   name, this VM (name and instance id) and the bucket's step it just verified (the newest
   authentic one, at least as new as the disk's): the control job acts on nothing else. It
   replaces whatever object has that name (a planted one, which the job would refuse). The stack
   reads these markers at the next deploy and keeps the group at zero (`stacks.scale_to_zero`); a
   VM that boots anyway (a manual resize) honours them (`honour`: step 1 again) and stops again.
3. It starts the control job, which stops a pool's coordinator and resizes every group of the
   experiment to zero, and waits for the job's outcome (`<prefix>/control/outcome.json`): exit 0
   when every step was confirmed, 1 when any failed or the job refused the marker (the outcome
   names each; event=stop_marker_refused). The marker is durable either way: the job's scheduled
   runs finish what a failed one left.

`python -m trainer.cloud.scale honour` (at boot): exit 10 after stopping again when a marker for this
experiment exists, 0 when there is none. `python -m trainer.cloud.scale successor` (flex-start): asks
the control job for the next VM (`<prefix>/control/successor.json`), unless a marker says the job
is done; `deadline` waits until the flex-start VM's end is near, stops the trainer (it saves and
exits 75) and then asks for the successor.

Settings come from `/etc/spottrain/scale.json` (`--config`), written by the startup script from
the stack's own values (`Settings` below). Exit status: 0 done, 1 an API call failed, 2 bad
input, 3 refused (not durable), 10 `honour` stopped the group.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import dataclasses
import os
import re
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from trainer import manifest_auth, retry, untrusted
from trainer.cloud import stop_marker
from trainer.cloud.control import outcome_object, successor_object
from trainer.cloud.gce import ApiError, Client, metadata

CONFIG = Path("/etc/spottrain/scale.json")
REASONS = ("finished", "bad-input")
EXIT_OK, EXIT_API, EXIT_BAD, EXIT_REFUSED, EXIT_HONOURED = 0, 1, 2, 3, 10
_STEP = re.compile(r"step-(\d{8,})$")


@dataclass(frozen=True)
class Settings:
    job: str  # the experiment's control job, projects/<p>/locations/<region>/jobs/<name>
    bucket: str
    prefix: str  # the job's object prefix, "runs/<experiment>"
    steps: int
    run_dir: str = "/mnt/spottrain/run"
    run_duration_s: int | None = None  # flex-start: the VM's maximum run duration
    stop_before_s: int = 600  # flex-start: stop the trainer this long before the VM's end
    answer_s: float = 900.0  # how long to wait for the control job's answer
    forbidden_retry_s: float = retry.IAM_GRANT.grace_s  # a 403 starting the job is retried this long
    poll_s: float = 5.0
    #: the run's checkpoint key (the boot fetches it before `honour`): what authenticates a
    #: checkpoint in the bucket; without it nothing there counts, and a stop is refused.
    checkpoint_key_file: str = "/run/spottrain/checkpoint.key"

    @classmethod
    def load(cls, path: Path) -> "Settings":
        data = json.loads(path.read_text())
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)}")
        return cls(**data)


def digest(script: str) -> str:
    """The stop-marker digest of a startup script (the stack computes the same at synthesis)."""
    return hashlib.sha256(script.encode()).hexdigest()[:16]


def markers(prefix: str, steps: int, script_digest: str) -> dict[str, str]:
    """reason -> the object name that records it (the stack's data sources read these names)."""
    # ".json" ends each name, so no name is a prefix of another (steps 2000 vs 20000).
    return {"finished": f"{prefix}/stop/finished-steps-{steps}.json",
            "bad-input": f"{prefix}/stop/bad-input-{script_digest}.json"}


#: A value a line shows as it is: a number, a name, a path, a URL. Anything else (an answer of the
#: control job, an API error's message, a reason) is text from outside: quoted (``untrusted.shown``).
_PLAIN = re.compile(r"^[A-Za-z0-9_./:@+-]{0,200}$")


def log(event: str, **fields: Any) -> None:
    parts = " ".join(f"{k}={v if isinstance(v, (int, float)) or _PLAIN.match(str(v)) else untrusted.shown(v)}"
                     for k, v in fields.items())
    print(f"spottrain-scale: event={event} {parts}".rstrip(), file=sys.stderr, flush=True)


def _newest_step(names: list[str]) -> int | None:
    steps = [int(m.group(1)) for n in names if n.endswith("/manifest.json")
             and (m := _STEP.search(n.rsplit("/", 2)[-2]))]
    return max(steps) if steps else None


def local_newest(run_dir: Path) -> int | None:
    """The newest step on this VM's disk that has a manifest (complete folders only)."""
    try:
        names = [f"{p.name}/manifest.json" for p in run_dir.iterdir() if (p / "manifest.json").is_file()]
    except OSError:
        return None
    return _newest_step([f"x/{n}" for n in names])


def read_key(path: str) -> bytes:
    """The checkpoint key's bytes; OSError or ValueError saying why it cannot be used."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not hang the stop
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            secret = f.read(4097)
    finally:
        os.close(fd)
    if not 32 <= len(secret) <= 4096:
        raise ValueError(f"{path} holds {len(secret)} bytes, not a checkpoint key")
    return secret


class Scaler:
    def __init__(self, settings: Settings, client: Client, script_digest: str) -> None:
        self.s, self.c, self.digest = settings, client, script_digest

    def markers(self) -> dict[str, str]:
        return markers(self.s.prefix, self.s.steps, self.digest)

    def durable(self, reason: str) -> tuple[bool, str, int | None, bytes | None]:
        """Would scaling to zero (which deletes this VM's disk) lose a checkpoint? (ok, why, the
        bucket's authentic step that covers the disk, the checkpoint key.) The key also signs the
        marker (`trainer.cloud.stop_marker`): without it nothing is durable, since nothing the
        control job could verify can be written."""
        s = self.s
        on_disk = local_newest(Path(s.run_dir))
        try:
            secret = read_key(s.checkpoint_key_file)
        except (OSError, ValueError) as e:
            return False, (f"cannot authenticate the bucket's checkpoints, nor sign the stop marker, without the "
                           f"checkpoint key ({e}); scaling to zero could delete the only authentic copy with the "
                           "disk"), None, None
        sizes = self.c.object_sizes(s.bucket, f"{s.prefix}/step-")
        if reason == "finished":
            why = self._unauthentic(s.steps, sizes, secret)
            if why is None:
                # The marker names the newest authentic step (an earlier, longer run's may be newer
                # than the final one): the control job refuses a marker the bucket has overtaken.
                newer, _ = stop_marker.newest_authentic(self._read, s.prefix, self._run, sizes, secret, above=s.steps)
                return (True, f"gs://{s.bucket}/{s.prefix}/step-{s.steps:08d} is there and authentic",
                        s.steps if newer is None else newer, secret)
            return False, (f"the final checkpoint gs://{s.bucket}/{s.prefix}/step-{s.steps:08d} is not in the "
                           f"bucket ({why}); its only copy may be on this VM's disk, which scaling to zero "
                           "would delete"), None, None
        # The newest authentic step (the marker names it: the control job refuses a marker when the
        # bucket later holds a newer one), which must cover the disk's newest.
        step, refused = stop_marker.newest_authentic(self._read, s.prefix, self._run, sizes, secret)
        if on_disk is None:
            return True, "no checkpoint on this VM's disk", step, secret
        if step is not None and step >= on_disk:
            return True, f"newest on disk {on_disk}, in the bucket {step} (authentic)", step, secret
        return False, (f"this VM's disk holds step {on_disk}, and the bucket no authentic copy of it or a newer "
                       f"one{' (' + '; '.join(refused[:5]) + ')' if refused else ''}: scaling to zero would "
                       "delete the newest checkpoint with the disk"), None, None

    @property
    def _run(self) -> str:
        return manifest_auth.run_uri(self.s.bucket, self.s.prefix)

    def _read(self, name: str) -> bytes | None:
        return self.c.read_object(self.s.bucket, name)

    def _unauthentic(self, step: int, sizes: dict[str, int], secret: bytes) -> str | None:
        """None when the bucket's ``step`` is authentic and complete (see the module docstring),
        else why not."""
        return stop_marker.unauthentic_step(self._read, self.s.prefix, self._run, step, sizes, secret)

    def stop(self, reason: str, detail: str = "") -> int:
        ok, why, step, secret = self.durable(reason)
        if not ok or secret is None:
            log("stop_refused", reason=reason, why=why)
            return EXIT_REFUSED
        marker = self.markers()[reason]
        instance_id = _safe_metadata("instance/id")
        if not instance_id:
            # The control job acts only on a marker whose writer is still a VM of the group.
            log("stop_refused", reason=reason, why="this VM's instance id is unknown (no metadata server)")
            return EXIT_API
        record = {"reason": reason, "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "instance": _safe_metadata("instance/name"), "instance_id": instance_id,
                  "detail": detail[:2000], "steps": self.s.steps, "startup_script_digest": self.digest,
                  "step": step, "disk_step": local_newest(Path(self.s.run_dir)), "run": self._run, "name": marker}
        # Overwritten, not create-only: an object already there may be a planted one (which the
        # control job refuses), and this record was verified just now. A writer who replaces it
        # again only delays the stop (the job refuses theirs and alerts).
        self.c.write_object(self.s.bucket, marker, stop_marker.sign(secret, record))
        log("stop_marker", object=f"gs://{self.s.bucket}/{marker}", step=step, durable=why)
        # A stale outcome (an earlier stop) must not pass for this one's.
        outcome = outcome_object(self.s.prefix)
        self.c.delete_object(self.s.bucket, outcome)
        self.start_control()
        answer = self.answer(outcome, lambda a: marker in a.get("markers", ()) or marker in (a.get("refused") or {}))
        if answer is None:
            log("stop_unconfirmed", why=(f"no answer from the control job in {self.s.answer_s:.0f}s; "
                                             "its scheduled runs will act on the marker"))
            return EXIT_API
        if marker in (answer.get("refused") or {}):
            log(stop_marker.REFUSED_EVENT, object=f"gs://{self.s.bucket}/{marker}", why=answer["refused"][marker])
            return EXIT_API
        for group, size in sorted((answer.get("groups") or {}).items()):
            log("group_resized" if size == 0 else "group_not_resized", group=group, target_size=size)
        if answer.get("coordinator") is not None:
            log("coordinator_stopped", status=answer["coordinator"])
        for line in answer.get("failures", ()):
            log("stop_failed", step=line)
        return EXIT_OK if answer.get("ok") else EXIT_API

    def start_control(self) -> None:
        """Start one execution of the control job; a 403 is retried while the VM's grant on the
        job propagates (IAM: typically 2 minutes, sometimes 7 or more)."""
        grant = retry.Retry(dataclasses.replace(retry.IAM_GRANT, grace_s=self.s.forbidden_retry_s),
                            transient=retry.never, sleep=self.c.sleep,
                            on_retry=lambda t: log("control_forbidden", job=self.s.job,
                                                   retry="the grant may be propagating"))
        op = grant.call(lambda: self.c.run_job(self.s.job), f"run {self.s.job}")
        log("control_started", job=self.s.job, operation=op.get("name", ""))

    def answer(self, name: str, mine: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        """The control job's answer in gs://bucket/name once it is about this request; None when
        none came within `answer_s`."""
        deadline = time.monotonic() + self.s.answer_s
        while True:
            raw = self.c.read_object(self.s.bucket, name)
            if raw is not None:
                try:
                    found = untrusted.loads(raw, limit=untrusted.SMALL_MAX_BYTES, what="the control job's answer")
                except untrusted.Garbage:
                    found = {}
                if isinstance(found, dict) and mine(found):
                    return found
            if time.monotonic() >= deadline:
                return None
            self.c.sleep(self.s.poll_s)

    def marker_present(self) -> str | None:
        for reason, name in self.markers().items():
            if self.c.object_exists(self.s.bucket, name):
                return reason
        return None

    def honour(self) -> int:
        reason = self.marker_present()
        if reason is None:
            return EXIT_OK
        log("stop_marker_found", reason=reason, object=f"gs://{self.s.bucket}/{self.markers()[reason]}")
        rc = self.stop(reason, detail="honoured at boot")
        return EXIT_HONOURED if rc == EXIT_OK else rc

    def successor(self, now: datetime | None = None) -> int:
        """Flex-start: one more VM for the job (it restores from GCS), through the control job."""
        if self.s.run_duration_s is None:
            log("successor_refused", why="not a flex-start group")
            return EXIT_BAD
        reason = self.marker_present()
        if reason is not None:
            log("successor_skipped", why=f"the job is stopped ({reason})")
            return EXIT_OK
        me = _safe_metadata("instance/name")
        if not me:
            log("successor_refused", why="this VM's name is unknown (no metadata server)")
            return EXIT_API
        at = (now or datetime.now(timezone.utc)).isoformat(timespec="seconds")
        name = successor_object(self.s.prefix)
        self.c.write_object(self.s.bucket, name, json.dumps({"instance": me, "at": at}, sort_keys=True).encode())
        self.start_control()
        answer = self.answer(name, lambda a: a.get("instance") == me and a.get("at") == at
                             and ("served" in a or "refused" in a))
        if answer is None or "served" not in answer:
            log("successor_failed", why=(answer.get("refused") if answer else
                                             f"no answer from the control job in {self.s.answer_s:.0f}s"))
            return EXIT_API
        log("successor_requested", resize_request=answer["served"], run_duration_s=self.s.run_duration_s)
        return EXIT_OK


def deadline_at(boot_time: float, run_duration_s: int, stop_before_s: int) -> float:
    """When a flex-start VM stops its trainer: its end (boot + run duration) less the margin the
    emergency save and upload need; never before it booted."""
    return max(boot_time, boot_time + run_duration_s - stop_before_s)


def boot_time() -> float:
    with open("/proc/stat") as f:
        return float(next(line.split()[1] for line in f if line.startswith("btime")))


def _safe_metadata(path: str) -> str:
    try:
        return metadata(path)
    except ApiError:
        return ""


def _script_digest() -> str:
    return digest(metadata("instance/attributes/startup-script"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.cloud.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=CONFIG)
    sub = p.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop", help="scale the group to zero (finished, bad-input)")
    stop.add_argument("reason", choices=REASONS)
    stop.add_argument("--detail", default="", help="what a human should know (kept in the marker)")
    sub.add_parser("honour", help="at boot: stop again if a stop marker exists (exit 10)")
    sub.add_parser("successor", help="flex-start: request the next VM")
    sub.add_parser("deadline", help="flex-start: stop the trainer before the VM's end, then request the next VM")
    a = p.parse_args(argv)
    try:
        settings = Settings.load(a.config)
    except (OSError, ValueError, TypeError) as e:
        print(f"{a.config}: {e}", file=sys.stderr)
        return EXIT_BAD
    try:
        scaler = Scaler(settings, Client(), _script_digest())
        if a.command == "stop":
            return scaler.stop(a.reason, a.detail)
        if a.command == "honour":
            return scaler.honour()
        if a.command == "successor":
            return scaler.successor()
        return run_deadline(scaler)
    except ApiError as e:
        log("api_error", code=e.code, status=e.status, message=e.message, url=e.url)
        if e.code == 403:
            log("hint", text=("the VM's service account may not start the control job or use its bucket: "
                                  "check roles/run.invoker on the job (docs/security.md); "
                                  "scale_to_zero_command does it by hand"))
        return EXIT_API


def run_deadline(scaler: Scaler) -> int:
    s = scaler.s
    if s.run_duration_s is None:
        log("deadline_refused", why="not a flex-start group")
        return EXIT_BAD
    at = deadline_at(boot_time(), s.run_duration_s, s.stop_before_s)
    log("deadline", stop_trainer_at=datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="seconds"))
    while (left := at - time.time()) > 0:
        time.sleep(min(left, 300.0))  # the wait is the point; re-read the clock after a suspend
    log("deadline_reached", action="stopping the trainer (it saves and exits 75)")
    subprocess.run(["systemctl", "stop", "spottrain.service"], check=False)
    return scaler.successor()


if __name__ == "__main__":
    sys.exit(main())
