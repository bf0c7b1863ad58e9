"""The experiment's control job: the one identity that changes the experiment's groups.

A training VM runs the user's code and every package it imports, so it holds no Compute
permission at all. What it may do is write into its bucket and start this job (Cloud Run,
`roles/run.invoker` on this one job); the job runs the delivered, sha256-pinned trainer package
(`stacks.control`) as its own service account. Why a job and not a role on the VM: IAM Conditions
cannot name an instance group manager (iam/docs/conditions-resource-attributes lists no such
resource type, and a condition on an attribute a resource does not provide "is never interpreted
as granting access"), and a group has no allow policy of its own, so the only grant that lets
anyone resize a group is one on the whole project. That grant belongs to code we ship, not to a
VM that runs a model's dependencies. docs/security.md has the whole map.

One execution (`python -m trainer.cloud.control`, settings in `SPOTTRAIN_CONTROL`, `Settings`), started
by a VM (`trainer.cloud.scale`) or by Cloud Scheduler as a backstop:

1. **Stopped** (a stop marker of `trainer.cloud.scale` is in the bucket *and verifies*): a pool's
   coordinator is stopped and every group is resized to zero, each step tried whatever happened to
   the others; then each is confirmed from the resource itself (the group's `targetSize`, the
   coordinator's `status`), never from the operation (which needs `compute.zoneOperations.get`,
   project-wide). The outcome goes to `<prefix>/control/outcome.json` for the VM that asked.

   Resizing to zero deletes every VM's checkpoint disk, and whoever can write the bucket can write
   a marker's name, so presence is never enough (`verified`, `trainer.cloud.stop_marker`): the
   marker must be a record the run signed with its checkpoint key (version 1 of the secret
   `checkpoint_key_secret`, read through Secret Manager's REST API with this job's grant on that
   one secret), bound to this run and to its object name; the step it names must be authentic and
   complete in the bucket now, with no newer authentic step there (training went on after it); and
   the VM that wrote it must still be one of the experiment's (a group member or the coordinator),
   unless the groups have no VM left (a stop already done). A marker that fails any of these is
   refused: the groups are left alone, the outcome lists it under `refused` with why, the job logs
   `{"event": "stop_marker_refused", "severity": "ERROR", ...}` (what an alert counts) and exits 1.
   docs/security.md says what is left of a replay. The judgement (`judge`, `read_key`, `members`)
   is shared with `make deploy` (`stacks.deploy`), whose plan would scale to zero on a marker too.
2. **Capacity** (the on-demand fallback, `trainer.cloud.capacity`): one check; it also takes both groups
   to zero when a marker verified.
3. **Successor** (flex-start): `<prefix>/control/successor.json` names the VM whose successor is
   wanted; if it is still a member of the group, one resize request of `resizeBy` 1 and the
   stack's run duration, named after that VM (so asking twice makes one), confirmed with
   `resizeRequests.get`; the answer is written back into the same object.

Exit status: 0 done (or nothing to do), 1 a call failed (each failure logged, all tried) or a
marker was refused and none acted on, 2 bad settings.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

from trainer import manifest_auth, untrusted
from trainer.cloud import capacity as cap
from trainer.cloud import stop_marker
from trainer.cloud.gce import ApiError, Client

ENV = "SPOTTRAIN_CONTROL"
EXIT_OK, EXIT_FAILED, EXIT_BAD = 0, 1, 2


class KeyProblem(Exception):
    """The checkpoint key cannot be read: no marker can be verified."""


@dataclass(frozen=True)
class Settings:
    project: str
    region: str
    location: str  # zones/<zone> or regions/<region>: every group of the experiment
    groups: tuple[str, ...]
    bucket: str
    prefix: str  # runs/<experiment>
    stop_markers: tuple[str, ...]  # object names: one that verifies (`verified`) means the job is done
    coordinator: str | None = None  # a pool's coordinator, zones/<zone>/instances/<name>
    flex_run_duration_s: int | None = None  # flex-start: the successor's run duration
    capacity: dict[str, Any] | None = None  # the on-demand fallback's `trainer.cloud.capacity.Settings`
    confirm_s: float = 600.0  # how long a change may take to show on the resource
    poll_s: float = 2.0
    #: projects/P/secrets/S: the run's checkpoint key, which verifies a marker (`trainer.cloud.stop_marker`)
    checkpoint_key_secret: str | None = None

    @property
    def outcome_object(self) -> str:
        return outcome_object(self.prefix)

    @property
    def successor_object(self) -> str:
        return successor_object(self.prefix)

    def group_path(self, group: str) -> str:
        return f"projects/{self.project}/{self.location}/instanceGroupManagers/{group}"

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        data = json.loads(text)
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)}")
        if not data.get("groups"):
            raise ValueError("groups: at least one group is required")
        return cls(**{**data, "groups": tuple(data["groups"]), "stop_markers": tuple(data["stop_markers"])})


def outcome_object(prefix: str) -> str:
    """Where an execution that found the job stopped reports what it did."""
    return f"{prefix}/control/outcome.json"


def successor_object(prefix: str) -> str:
    """Where a flex-start VM asks for its successor, and the control job answers."""
    return f"{prefix}/control/successor.json"


def successor_name(group: str, instance: str) -> str:
    """The resize request for `instance`'s successor: one per VM, a valid Compute name (<= 63)."""
    name = f"{group}-after-{instance}"
    if len(name) <= 63:
        return name
    return f"{name[:46]}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- may a stop marker be acted on? Shared by this job and `make deploy` (`stacks.deploy`) ----------
@dataclass
class Verdict:
    ok: list[str]  # the markers that may be acted on
    refused: dict[str, str]  # marker -> why not (a call that failed on it included)
    failures: list[tuple[str, ApiError]]  # (what was tried, the error): a call that failed


def read_key(client: Client, secret: str) -> bytes:
    """The run's checkpoint key, version 1 of ``secret`` (`projects/P/secrets/S`: the version the
    VMs read and sign with), held in memory only; KeyProblem or ApiError when it cannot be had.
    Never created here: a key made up by the reader would verify nothing."""
    data = client.secret_version(secret, "1")
    if data is None:
        raise KeyProblem(f"{secret} has no version 1: no VM of this experiment has booted")
    if not 32 <= len(data) <= 4096:
        raise KeyProblem(f"{secret} version 1 holds {len(data)} bytes, not a checkpoint key")
    return data


def members(client: Client, groups: list[str], coordinator: str | None, *,
            absent_ok: bool = False) -> tuple[int, set[str]]:
    """How many VMs a resize to zero would delete now (every group's members, with their disks) and
    the ids of the VMs that may have written a marker (those, and a pool's coordinator, which is
    only stopped: its disk stays). ``groups``, ``coordinator``: full resource paths
    (`projects/P/zones/Z/instanceGroupManagers/G`, `projects/P/zones/Z/instances/I`).
    ``absent_ok``: a group that does not exist (404) has no VM (a deploy before the group is
    created); the job, whose groups the stack made, treats a 404 as the failure it is."""
    count, ids = 0, set()
    for g in groups:
        try:
            answer = client.compute_call("POST", f"{g}/listManagedInstances")
        except ApiError as e:
            if not (absent_ok and e.code == 404):
                raise
            continue
        count += len(answer.get("managedInstances", []))
        ids |= stop_marker.member_ids(answer)
    if coordinator:
        vm = client.compute_call("GET", coordinator, ok404=True)
        if vm is not None and vm.get("id"):
            ids.add(str(vm["id"]))
    return count, ids


def judge(client: Client, *, bucket: str, prefix: str, found: list[str], secret: bytes,
          members: Callable[[], tuple[int, set[str]]]) -> Verdict:
    """Which of the marker objects ``found`` in ``bucket`` may scale the experiment to zero: each
    must be a record the run signed (`stop_marker.verify`), bound to this run and to its own object
    name; the step it names must be authentic and complete in the bucket now, with no newer
    authentic step there; and its writer must still be one of the experiment's VMs unless none is
    left (`stop_marker.stale`; ``members`` as `members` answers, asked at most once). A call that
    fails refuses the marker it was for: what could not be checked is not known to be safe."""
    run = manifest_auth.run_uri(bucket, prefix)
    verdict = Verdict([], {}, [])
    sizes: dict[str, int] | None = None
    vms: tuple[int, set[str]] | None = None

    def read(n: str) -> bytes | None:
        return client.read_object(bucket, n)

    for name in found:
        try:
            raw = client.read_object(bucket, name)
            if raw is None:
                continue  # deleted since it was found: nothing to act on, nothing to refuse
            record, why = stop_marker.verify(raw, secret, name=name, run=run)
            if record is None:
                verdict.refused[name] = why
                continue
            if sizes is None:
                sizes = client.object_sizes(bucket, f"{prefix}/step-")
            step = record.get("step")
            if step is not None:
                bad = stop_marker.unauthentic_step(read, prefix, run, step, sizes, secret)
                if bad is not None:
                    verdict.refused[name] = f"its step {step} in the bucket is not authentic and complete: {bad}"
                    continue
            newer, _ = stop_marker.newest_authentic(read, prefix, run, sizes, secret,
                                                    above=-1 if step is None else step)
            if vms is None:
                vms = members()
            stale = stop_marker.stale(record, vms=vms[0], ids=vms[1], newer=newer)
            if stale is not None:
                verdict.refused[name] = stale
                continue
            verdict.ok.append(name)
        except ApiError as e:
            verdict.failures.append((f"verify gs://{bucket}/{name}", e))
            verdict.refused[name] = f"could not be verified ({e})"
    return verdict


class Control:
    def __init__(self, settings: Settings, client: Client,
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> None:
        self.s, self.c, self.log = settings, client, log
        self.failures: list[str] = []
        self.refused: dict[str, str] = {}  # marker -> why it was not acted on

    def say(self, event: str, **fields: Any) -> None:
        self.log(json.dumps({"event": event, **fields}, sort_keys=True))

    def fail(self, what: str, error: Exception) -> None:
        line = f"{what}: {error}"
        self.failures.append(line)
        self.say("control_failed", what=what, error=str(error))

    def run(self) -> int:
        s = self.s
        self.failures, self.refused = [], {}
        found = [m for m in s.stop_markers if self.c.object_exists(s.bucket, m)]
        markers = self.verified(found) if found else []
        if s.capacity is not None:
            # The fallback takes both groups to zero only on a marker that verified here.
            check = cap.Check(cap.Settings.from_dict(s.capacity), self.c, log=self.log, stopped=bool(markers))
            check.run()
            for line in check.failures:
                self.failures.append(line)
        if markers:
            self.stop(markers, resize=s.capacity is None)
        else:
            if self.refused:  # the VM that asked learns why nothing happened
                self.write_outcome({"groups": {}, "coordinator": None})
            if s.flex_run_duration_s is not None:
                self.successor()
        if self.failures or (self.refused and not markers):
            return EXIT_FAILED
        return EXIT_OK

    # --- may the job act on a stop marker? (`trainer.cloud.stop_marker`) ---------------------
    def verified(self, found: list[str]) -> list[str]:
        """The markers among ``found`` that the run wrote and that still hold; each other one is
        refused (`refused`, event `stop_marker_refused`) and the groups are left alone for it.
        Scaling to zero deletes every VM's checkpoint disk: it is safe only when the bucket holds an
        authentic checkpoint at least as new as every disk's, which only the run can attest."""
        s = self.s
        try:
            secret = self.key()
        except (ApiError, KeyProblem) as e:
            self.fail(f"read the checkpoint key {s.checkpoint_key_secret}", e)
            for m in found:
                self.refuse(m, f"cannot verify it without the checkpoint key ({e})")
            return []
        verdict = judge(self.c, bucket=s.bucket, prefix=s.prefix, found=found, secret=secret,
                        members=self.members)
        for what, error in verdict.failures:
            self.fail(what, error)
        for name, why in verdict.refused.items():
            self.refuse(name, why)
        return verdict.ok

    def members(self) -> tuple[int, set[str]]:
        """How many VMs a resize to zero would delete now, and the ids of the VMs that may have
        written a marker (`members`)."""
        s = self.s
        return members(self.c, [s.group_path(g) for g in s.groups],
                       f"projects/{s.project}/{s.coordinator}" if s.coordinator else None)

    def key(self) -> bytes:
        """The run's checkpoint key (`read_key`), read only when a marker is there to verify."""
        if not self.s.checkpoint_key_secret:
            raise KeyProblem("the job's settings name no checkpoint_key_secret")
        return read_key(self.c, self.s.checkpoint_key_secret)

    def refuse(self, name: str, why: str) -> None:
        self.refused[name] = why
        # What an alert acts on (`stacks.run_metrics`): a marker that would have scaled the job to
        # zero, and whose deletion of the disks the run never vouched for.
        self.say(stop_marker.REFUSED_EVENT, severity="ERROR", marker=f"gs://{self.s.bucket}/{name}", why=why,
                 action="groups left alone: a human must look (docs/security.md, stop markers)")

    def write_outcome(self, fields: dict[str, Any], markers: list[str] | tuple[str, ...] = ()) -> None:
        s = self.s
        outcome = {"at": _now(), "markers": list(markers), "refused": dict(self.refused), **fields,
                   "failures": list(self.failures), "ok": not self.failures and not (self.refused and not markers)}
        try:
            self.c.write_object(s.bucket, s.outcome_object, json.dumps(outcome, sort_keys=True).encode())
        except ApiError as e:
            self.fail(f"write gs://{s.bucket}/{s.outcome_object}", e)

    # --- the job is done: nothing of it may keep running --------------------------------------
    def stop(self, markers: list[str], resize: bool = True) -> None:
        s = self.s
        self.say("control_stop", markers=markers)
        coordinator_asked = False
        if s.coordinator:  # it hosts the rendezvous; its workers are going anyway
            path = f"projects/{s.project}/{s.coordinator}"
            try:
                if self.c.compute_call("GET", path).get("status") != "TERMINATED":
                    self.c.compute_call("POST", f"{path}/stop")
                coordinator_asked = True
            except ApiError as e:
                self.fail(f"stop {s.coordinator}", e)
        asked = []
        for group in s.groups:
            if not resize:  # the capacity check resized them; confirm what it did not fail at
                if not any(f.startswith(f"{group}:") for f in self.failures):
                    asked.append(group)
                continue
            try:
                if int(self.c.compute_call("GET", s.group_path(group)).get("targetSize", -1)) != 0:
                    self.c.compute_call("POST", f"{s.group_path(group)}/resize", query={"size": 0})
                asked.append(group)
            except ApiError as e:
                self.fail(f"resize {group} to 0", e)
        # Each change that was accepted, confirmed on the resource itself (not on its operation).
        sizes: dict[str, int | None] = {g: None for g in s.groups}
        for group in asked:
            try:
                answer = self.c.until(lambda: self.c.compute_call("GET", s.group_path(group)),
                                      lambda g: int(g.get("targetSize", -1)) == 0, f"{group} at size 0",
                                      s.confirm_s, s.poll_s)
                sizes[group] = int(answer["targetSize"])
                self.say("group_resized", group=group, target_size=0)
            except ApiError as e:
                self.fail(f"confirm {group} at size 0", e)
        coordinator = None
        if coordinator_asked:
            try:
                coordinator = self.c.until(
                    lambda: self.c.compute_call("GET", f"projects/{s.project}/{s.coordinator}"),
                    lambda i: i.get("status") == "TERMINATED", f"{s.coordinator} stopped",
                    s.confirm_s, s.poll_s)["status"]
                self.say("instance_stopped", instance=s.coordinator)
            except ApiError as e:
                self.fail(f"confirm {s.coordinator} stopped", e)
        self.write_outcome({"groups": sizes, "coordinator": coordinator}, markers)

    # --- flex-start: the next VM of the job ---------------------------------------------------
    def successor(self) -> None:
        s = self.s
        raw = self.c.read_object(s.bucket, s.successor_object)
        if raw is None:
            return
        try:
            asked = untrusted.loads(raw, limit=untrusted.SMALL_MAX_BYTES, what="a successor request")
            instance = str(asked["instance"])
        except (ValueError, KeyError, TypeError):
            self.fail(f"read gs://{s.bucket}/{s.successor_object}", ValueError("not a successor request"))
            return
        if "served" in asked or "refused" in asked:
            return
        group = s.groups[0]
        answer: dict[str, Any] = {**asked, "at_answered": _now()}
        try:
            members = self.c.compute_call("POST", f"{s.group_path(group)}/listManagedInstances")
            names = {m.get("name") or str(m.get("instance", "")).rsplit("/", 1)[-1]
                     for m in members.get("managedInstances", [])}
            if instance not in names:
                answer["refused"] = f"{instance} is not a VM of {group}"
                self.say("successor_refused", instance=instance, why=answer["refused"])
            else:
                name = successor_name(group, instance)
                body = {"name": name, "resizeBy": 1,
                        "requestedRunDuration": {"seconds": str(s.flex_run_duration_s)},
                        "description": f"spottrain: the flex-start VM after {instance} (resumes from GCS)"}
                try:
                    self.c.compute_call("POST", f"{s.group_path(group)}/resizeRequests", body=body)
                except ApiError as e:
                    if e.code != 409:  # 409: this VM's successor was asked for already
                        raise
                self.c.until(lambda: self.c.compute_call("GET", f"{s.group_path(group)}/resizeRequests/{name}",
                                                         ok404=True),
                             lambda r: r is not None, f"resize request {name}", s.confirm_s, s.poll_s)
                answer["served"] = name
                self.say("successor_requested", instance=instance, resize_request=name,
                         run_duration_s=s.flex_run_duration_s)
        except ApiError as e:
            self.fail(f"successor of {instance}", e)
            answer["refused"] = str(e)
        try:
            self.c.write_object(s.bucket, s.successor_object, json.dumps(answer, sort_keys=True).encode())
        except ApiError as e:
            self.fail(f"write gs://{s.bucket}/{s.successor_object}", e)


def main() -> int:
    try:
        settings = Settings.from_json(os.environ[ENV])
    except (KeyError, ValueError, TypeError) as e:
        print(f"{ENV}: {e!r}", file=sys.stderr)
        return EXIT_BAD
    control = Control(settings, Client())
    try:
        rc = control.run()
    except ApiError as e:  # a read the whole run depends on (the markers, the state)
        control.fail("control run", e)
        rc = EXIT_FAILED
    control.say("control_done", status=rc, failures=control.failures)
    return rc


if __name__ == "__main__":
    sys.exit(main())
