"""A fake of the Google Cloud REST APIs our own code calls, on loopback, speaking the real protocol.

What cannot exist here is faked, and only that: the Compute Engine API (the part the VM-side
scale-to-zero call, the capacity check and `make preflight` use), the Service Usage API, Secret
Manager (the experiment's checkpoint key, `trainer.checkpoint_key`), and the OAuth 2.0 token
endpoint that application-default credentials refresh against. Clients talk plain HTTP with the
real paths and JSON bodies, pointed here by their endpoint settings (`SPOTTRAIN_COMPUTE_API`,
`SPOTTRAIN_SERVICEUSAGE_API`, `SPOTTRAIN_SECRETMANAGER_API`, an ADC file's `token_uri`).

Protocol kept (cloud.google.com/compute/docs/reference/rest/v1, /serviceusage/docs/reference/rest):
- every call needs `Authorization: Bearer TOKEN` (401 otherwise); errors are Google's JSON error
  `{"error": {"code", "message", "status", "errors": [{"reason", "message"}]}}`;
- `instanceGroupManagers` and `regionInstanceGroupManagers`: get, resize (`?size=N`),
  listManagedInstances, resizeRequests insert/list (flex-start), each mutation answering an
  Operation that is RUNNING when returned and DONE at the next `operations.get`/`wait`;
- `instances` get/stop/start; `zoneOperations`/`regionOperations` get and wait;
- `regions.get` (status, zones, quotas), `machineTypes.get` per zone, `images.getFromFamily`,
  `regions/{r}/advice/capacity` (beta and v1 paths; the obtainability score per zone);
- Service Usage `services.get` and `services:batchGet`; `POST /token` (refresh-token and JWT-bearer
  grants);
- Secret Manager (cloud.google.com/secret-manager/docs/reference/rest): `secrets.addVersion`
  (`POST .../secrets/S:addVersion`, `{"payload": {"data": BASE64}}`, versions numbered from 1) and
  `secrets.versions.access` (`GET .../secrets/S/versions/V:access`, V a number or `latest`; 404
  for a missing secret or version, 400 FAILED_PRECONDITION for a disabled or destroyed one). The
  secrets themselves come from the "stack": `add_secret`.

The world behind it is a small model: groups with a target size and instances; a group the fake
manages itself (`auto=True`) creates an instance when `capacity(zone, provisioning_model)` says
there is capacity and deletes surplus ones, which is how the capacity simulation refuses Spot for
T minutes; a group the drill manages (`auto=False`) only records its target size, and the drill's
VM stand-in reads it. Time is `clock()`, so a simulation can run minutes in microseconds.
"""
from __future__ import annotations

import itertools
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from drill.quiet_http import QuietHTTPServer

COMPUTE_PREFIXES = ("/compute/v1/", "/compute/beta/")
SERVICEUSAGE_PREFIX = "/v1/"


class Refused(Exception):
    """An API error the fake answers: HTTP status, Google status name, message."""

    def __init__(self, code: int, status: str, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code, self.status, self.message = code, status, message
        self.reason = reason or status.lower()


def _not_found(what: str) -> Refused:
    return Refused(404, "NOT_FOUND", f"The resource '{what}' was not found", "notFound")


@dataclass
class Instance:
    name: str
    zone: str
    provisioning: str  # SPOT | STANDARD | FLEX_START
    status: str = "RUNNING"  # PROVISIONING, RUNNING, STOPPING, TERMINATED
    created: float = 0.0
    machine_type: str = ""


@dataclass
class Group:
    """One managed instance group. `zone` for a zonal group, `region` (and `zones`) for a
    regional one. `auto`: the fake creates and deletes its instances (the simulation); otherwise
    `instances` is whatever the test registered (the drill's VM) and only `target_size` moves."""

    name: str
    zones: tuple[str, ...]
    region: str | None = None
    target_size: int = 1
    provisioning: str = "SPOT"
    machine_type: str = "g2-standard-8"
    auto: bool = False
    instances: dict[str, Instance] = field(default_factory=dict)
    resize_requests: list[dict[str, Any]] = field(default_factory=list)
    #: (time, target size) after every change, the first entry the initial size
    history: list[tuple[float, int]] = field(default_factory=list)
    _seq: itertools.count = field(default_factory=lambda: itertools.count(1), repr=False)

    @property
    def regional(self) -> bool:
        return self.region is not None

    @property
    def location(self) -> str:
        return f"regions/{self.region}" if self.region else f"zones/{self.zones[0]}"

    def running(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.status == "RUNNING"]


@dataclass
class Operation:
    name: str
    kind: str  # e.g. compute.instanceGroupManagers.resize
    location: str  # zones/Z or regions/R
    target: str
    status: str = "RUNNING"
    error: dict[str, Any] | None = None


@dataclass
class Call:
    """One request as the fake saw it (for tests and reports)."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    status: int = 0


class FakeGcp:
    """The fake APIs of one project; a context manager. `clock` defaults to wall time."""

    def __init__(self, project: str = "spottrain-drill", *, clock: Callable[[], float] | None = None,
                 token: str = "fake-access-token") -> None:
        self.project = project
        self.clock = clock or time.time
        self.token = token
        self._lock = threading.Condition()
        self.groups: dict[str, Group] = {}
        self.standalone: dict[tuple[str, str], Instance] = {}  # (zone, name): not in a group
        self.operations: dict[str, Operation] = {}
        self._op_seq = itertools.count(1)
        self.calls: list[Call] = []
        #: Capacity: (zone, provisioning model) -> can a VM be created there now?
        self.capacity: Callable[[str, str], bool] = lambda zone, model: True
        #: Capacity advice: (zone, provisioning model, machine type) -> obtainability 0..1; by
        #: default derived from `capacity` (0.9 with capacity, 0.1 without).
        self.obtainability: Callable[[str, str, str], float] | None = None
        self.regions: dict[str, dict[str, Any]] = {}
        self.machine_types: dict[str, set[str]] = {}  # zone -> machine types offered
        self.images: dict[tuple[str, str], dict[str, Any]] = {}  # (project, family) -> image
        self.services: dict[str, str] = {}  # service name -> ENABLED | DISABLED
        #: (method, path regex, times left or None for ever) answered 403, as IAM would for a
        #: missing permission (or one still propagating)
        self.denied: list[list[Any]] = []
        #: Secret Manager: secret resource name -> versions (1-based), each {"data", "state"}
        self.secrets: dict[str, list[dict[str, Any]]] = {}
        self.refresh_tokens: set[str] = set()
        self.service_accounts: set[str] = set()  # emails whose signed JWTs the token endpoint accepts
        self.preemptions: list[tuple[float, str, str]] = []  # (time, group, instance) of auto groups
        self._httpd: QuietHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> "FakeGcp":
        fake = self

        class Handler(_Handler):
            gcp = fake

        self._httpd = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-gcp", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> "FakeGcp":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    @property
    def compute_api(self) -> str:
        """The value for SPOTTRAIN_COMPUTE_API (what https://compute.googleapis.com/compute/v1 is)."""
        return f"{self.url}/compute/v1"

    @property
    def serviceusage_api(self) -> str:
        return f"{self.url}/v1"

    @property
    def secretmanager_api(self) -> str:
        """The value for SPOTTRAIN_SECRETMANAGER_API (what https://secretmanager.googleapis.com/v1 is)."""
        return f"{self.url}/v1"

    @property
    def token_uri(self) -> str:
        return f"{self.url}/token"

    # --- the world -------------------------------------------------------------------------
    def add_group(self, name: str, *, zone: str | None = None, region: str | None = None,
                  zones: tuple[str, ...] = (), target_size: int = 1, provisioning: str = "SPOT",
                  machine_type: str = "g2-standard-8", auto: bool = False,
                  instances: tuple[str, ...] = ()) -> Group:
        if (zone is None) == (region is None):
            raise ValueError("a group is zonal (zone=) or regional (region=, zones=)")
        group = Group(name, (zone,) if zone else tuple(zones), region, target_size, provisioning,
                      machine_type, auto)
        for n in instances:
            group.instances[n] = Instance(n, group.zones[0], provisioning, created=self.clock(),
                                          machine_type=machine_type)
        group.history.append((self.clock(), target_size))
        with self._lock:
            self.groups[name] = group
            self._reconcile(group)
        return group

    def add_instance(self, zone: str, name: str, *, provisioning: str = "STANDARD",
                     status: str = "RUNNING") -> Instance:
        """A VM outside any group (a pool's coordinator)."""
        inst = Instance(name, zone, provisioning, status, self.clock())
        with self._lock:
            self.standalone[(zone, name)] = inst
        return inst

    def add_region(self, region: str, zones: tuple[str, ...], quotas: dict[str, float],
                   machine_types: tuple[str, ...] = ()) -> None:
        self.regions[region] = {"zones": zones, "quotas": dict(quotas)}
        for z in zones:
            self.machine_types.setdefault(z, set()).update(machine_types)

    def add_image(self, project: str, family: str, name: str | None = None) -> None:
        self.images[(project, family)] = {"name": name or f"{family}-v20260101", "family": family,
                                          "status": "READY"}

    def deny(self, method: str, path_regex: str, times: int | None = None) -> None:
        """Answer 403 to matching calls (IAM refusing the caller), e.g. deny("POST", "/resize");
        with `times`, only to that many (a grant that is still propagating)."""
        self.denied.append([method.upper(), path_regex, times])

    def add_secret(self, secret_id: str) -> str:
        """A Secret Manager secret of this project, without versions (as the stack creates it);
        its resource name. Idempotent."""
        name = f"projects/{self.project}/secrets/{secret_id}"
        with self._lock:
            self.secrets.setdefault(name, [])
        return name

    def secret_versions(self, name: str) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(v) for v in self.secrets[name]]

    def set_target(self, name: str, size: int) -> None:
        """Resize a group from outside the API (a human with gcloud, in the drill)."""
        with self._lock:
            self._set_target(self.groups[name], size)
            self._lock.notify_all()

    def group(self, name: str) -> Group:
        with self._lock:
            return self.groups[name]

    def tick(self) -> None:
        """Let every auto group converge on its target at the current `clock()` (the simulation
        calls it as its clock advances; requests also do)."""
        with self._lock:
            for g in self.groups.values():
                self._reconcile(g)

    def wait_for(self, pred: Callable[["FakeGcp"], bool], timeout: float) -> bool:
        """Block until `pred(self)` holds (re-checked after every call the fake answers)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not pred(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def calls_to(self, method: str, fragment: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.method == method and fragment in c.path]

    # --- the model -------------------------------------------------------------------------
    def _set_target(self, g: Group, size: int) -> None:
        g.target_size = size
        g.history.append((self.clock(), size))
        self._reconcile(g)

    def _reconcile(self, g: Group) -> None:
        if not g.auto:
            return
        for inst in list(g.instances.values()):  # Spot capacity gone: preempted (and deleted)
            if inst.provisioning == "SPOT" and not self.capacity(inst.zone, "SPOT"):
                del g.instances[inst.name]
                self.preemptions.append((self.clock(), g.name, inst.name))
        live = sorted(g.instances.values(), key=lambda i: i.created)
        for inst in live[g.target_size:]:  # surplus: deleted (SIGTERM, save, gone)
            del g.instances[inst.name]
        while len(g.instances) < g.target_size:
            zone = next((z for z in g.zones if self.capacity(z, g.provisioning)), None)
            if zone is None:
                return  # stockout: the group keeps trying (currentActions.creating)
            name = f"{g.name.removesuffix('-group')}-{next(g._seq):04d}"
            g.instances[name] = Instance(name, zone, g.provisioning, created=self.clock(),
                                         machine_type=g.machine_type)

    def _operation(self, kind: str, location: str, target: str) -> dict[str, Any]:
        op = Operation(f"operation-{next(self._op_seq):06d}", kind, location, target)
        self.operations[op.name] = op
        return self._op_json(op)

    def _op_json(self, op: Operation) -> dict[str, Any]:
        where = op.location.split("/", 1)
        out = {"kind": "compute#operation", "name": op.name, "operationType": op.kind.rsplit(".", 1)[-1],
               "targetLink": f"{self.compute_api}/projects/{self.project}/{op.target}",
               "status": op.status, "progress": 100 if op.status == "DONE" else 0,
               "selfLink": f"{self.compute_api}/projects/{self.project}/{op.location}/operations/{op.name}",
               where[0][:-1]: f"{self.compute_api}/projects/{self.project}/{op.location}"}
        if op.error:
            out["error"] = op.error
        return out

    def _group_json(self, g: Group) -> dict[str, Any]:
        base = f"{self.compute_api}/projects/{self.project}/{g.location}/instanceGroupManagers/{g.name}"
        creating = max(0, g.target_size - len(g.instances)) if g.auto else 0
        out: dict[str, Any] = {
            "kind": "compute#instanceGroupManager", "name": g.name, "selfLink": base,
            "baseInstanceName": g.name.removesuffix("-group"), "targetSize": g.target_size,
            "currentActions": {"none": len(g.running()), "creating": creating, "deleting": 0},
            "status": {"isStable": creating == 0},
        }
        if g.regional:
            out["region"] = f"{self.compute_api}/projects/{self.project}/regions/{g.region}"
            out["distributionPolicy"] = {"zones": [{"zone": f"{self.compute_api}/projects/{self.project}/zones/{z}"}
                                                   for z in g.zones]}
        else:
            out["zone"] = f"{self.compute_api}/projects/{self.project}/zones/{g.zones[0]}"
        return out

    def _managed(self, g: Group) -> dict[str, Any]:
        items = [{"instance": f"{self.compute_api}/projects/{self.project}/zones/{i.zone}/instances/{i.name}",
                  "name": i.name, "instanceStatus": i.status, "currentAction": "NONE"}
                 for i in sorted(g.instances.values(), key=lambda i: i.created)]
        if g.auto:
            items += [{"name": f"{g.name.removesuffix('-group')}-pending-{n}", "currentAction": "CREATING",
                       "lastAttempt": {"errors": {"errors": [{"code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                                                              "message": "The zone does not have enough "
                                                              "resources available to fulfill the request."}]}}}
                      for n in range(max(0, g.target_size - len(g.instances)))]
        return {"managedInstances": items}

    def _find_instance(self, zone: str, name: str) -> Instance:
        for g in self.groups.values():
            inst = g.instances.get(name)
            if inst is not None and inst.zone == zone:
                return inst
        inst = self.standalone.get((zone, name))
        if inst is None:
            raise _not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
        return inst

    def _obtainability(self, zone: str, model: str, machine_type: str) -> float:
        if self.obtainability is not None:
            return self.obtainability(zone, model, machine_type)
        return 0.9 if self.capacity(zone, model) else 0.1

    # --- request dispatch ------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        with self._lock:
            call = Call(method, path, query, body)
            self.calls.append(call)
            try:
                for entry in self.denied:
                    m, rx, times = entry
                    if m == method and re.search(rx, path) and (times is None or times > 0):
                        if times is not None:
                            entry[2] = times - 1
                        raise Refused(403, "PERMISSION_DENIED", f"Required permission denied for {path}",
                                      "forbidden")
                for g in self.groups.values():
                    self._reconcile(g)
                status, answer = 200, self._dispatch(method, path, query, body)
            except Refused as e:
                status = e.code
                answer = {"error": {"code": e.code, "message": e.message, "status": e.status,
                                    "errors": [{"reason": e.reason, "message": e.message, "domain": "global"}]}}
            call.status = status
            self._lock.notify_all()
            return status, answer

    def _dispatch(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> Any:
        prefix = next((p for p in COMPUTE_PREFIXES if path.startswith(p)), None)
        if prefix is not None:
            return self._compute(method, path[len(prefix):].strip("/").split("/"), query, body)
        if path.startswith(SERVICEUSAGE_PREFIX) and "/secrets/" in path:
            return self._secretmanager(method, path[len(SERVICEUSAGE_PREFIX):], body)
        if path.startswith(SERVICEUSAGE_PREFIX):
            return self._serviceusage(method, path[len(SERVICEUSAGE_PREFIX):], query)
        raise _not_found(path)

    def _secretmanager(self, method: str, rest: str, body: Any) -> Any:
        import base64
        import binascii

        m = re.fullmatch(r"(projects/([^/]+)/secrets/([^/:]+))(?::addVersion|/versions/([^/:]+):access)", rest)
        if m is None:
            raise _not_found(rest)
        name, project, version = m.group(1), m.group(2), m.group(4)
        if project != self.project:
            raise Refused(403, "PERMISSION_DENIED", f"Permission denied on resource project {project}.",
                          "forbidden")
        versions = self.secrets.get(name)
        if rest.endswith(":addVersion") and method == "POST":
            if versions is None:
                raise _not_found(f"Secret [{name}]")
            try:
                data = base64.b64decode(str((body or {})["payload"]["data"]), validate=True)
            except (KeyError, TypeError, binascii.Error):
                raise Refused(400, "INVALID_ARGUMENT", "Invalid resource field value in the request.",
                              "badRequest") from None
            versions.append({"data": data, "state": "ENABLED", "created": self.clock()})
            return {"name": f"{name}/versions/{len(versions)}", "state": "ENABLED",
                    "createTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))}
        if version is not None and method == "GET":
            if not versions:
                raise Refused(404, "NOT_FOUND", f"Secret [{name}] not found or has no versions.", "notFound")
            n = len(versions) if version == "latest" else int(version) if version.isdigit() else 0
            if not 1 <= n <= len(versions):
                raise Refused(404, "NOT_FOUND", f"Secret Version [{name}/versions/{version}] not found.",
                              "notFound")
            v = versions[n - 1]
            if v["state"] != "ENABLED":
                raise Refused(400, "FAILED_PRECONDITION", f"Secret Version [{name}/versions/{n}] is in "
                              f"{v['state']} state.", "failedPrecondition")
            return {"name": f"{name}/versions/{n}", "payload": {"data": base64.b64encode(v["data"]).decode()}}
        raise _not_found(rest)

    def _compute(self, method: str, p: list[str], query: dict[str, list[str]], body: Any) -> Any:
        if len(p) < 2 or p[0] != "projects":
            raise _not_found("/".join(p))
        project, rest = p[1], p[2:]
        if rest[:3] == ["global", "images", "family"] and len(rest) == 4 and method == "GET":
            image = self.images.get((project, rest[3]))
            if image is None:
                raise _not_found(f"projects/{project}/global/images/family/{rest[3]}")
            return {"kind": "compute#image", **image,
                    "selfLink": f"{self.compute_api}/projects/{project}/global/images/{image['name']}"}
        if project != self.project:
            raise Refused(403, "PERMISSION_DENIED", f"Permission denied on project {project}", "forbidden")
        if len(rest) < 2 or rest[0] not in ("zones", "regions"):
            raise _not_found("/".join(p))
        location = f"{rest[0]}/{rest[1]}"
        kind, tail = rest[2:3], rest[3:]
        if not kind:
            if rest[0] == "regions" and method == "GET":
                return self._region(rest[1])
            raise _not_found("/".join(p))
        if kind == ["instanceGroupManagers"] and tail:
            return self._igm(method, location, tail, query, body)
        if kind == ["instances"] and tail:
            return self._instance(method, rest[1], tail)
        if kind == ["operations"] and tail:
            op = self.operations.get(tail[0])
            if op is None or op.location != location:
                raise _not_found(f"{location}/operations/{tail[0]}")
            op.status = "DONE"  # RUNNING when it was returned; done by the time anyone asks
            return self._op_json(op)
        if kind == ["machineTypes"] and len(tail) == 1 and rest[0] == "zones" and method == "GET":
            if tail[0] not in self.machine_types.get(rest[1], set()):
                raise _not_found(f"projects/{project}/zones/{rest[1]}/machineTypes/{tail[0]}")
            return {"kind": "compute#machineType", "name": tail[0], "zone": rest[1]}
        if kind == ["advice"] and tail == ["capacity"] and rest[0] == "regions" and method == "POST":
            return self._advice(rest[1], body or {})
        raise _not_found("/".join(p))

    def _region(self, region: str) -> dict[str, Any]:
        r = self.regions.get(region)
        if r is None:
            raise _not_found(f"projects/{self.project}/regions/{region}")
        return {"kind": "compute#region", "name": region, "status": "UP",
                "zones": [f"{self.compute_api}/projects/{self.project}/zones/{z}" for z in r["zones"]],
                "quotas": [{"metric": m, "limit": v, "usage": 0.0} for m, v in sorted(r["quotas"].items())]}

    def _igm(self, method: str, location: str, tail: list[str], query: dict[str, list[str]], body: Any) -> Any:
        g = self.groups.get(tail[0])
        if g is None or g.location != location:
            raise _not_found(f"projects/{self.project}/{location}/instanceGroupManagers/{tail[0]}")
        target = f"{location}/instanceGroupManagers/{g.name}"
        verb = tail[1] if len(tail) > 1 else None
        if verb is None and method == "GET":
            return self._group_json(g)
        if verb == "resize" and method == "POST":
            try:
                size = int(query["size"][0])
            except (KeyError, ValueError):
                raise Refused(400, "INVALID_ARGUMENT", "Required 'size' is missing or invalid", "required")
            if size < 0:
                raise Refused(400, "INVALID_ARGUMENT", "Invalid value for field 'size'", "invalid")
            self._set_target(g, size)
            return self._operation("compute.instanceGroupManagers.resize", location, target)
        if verb == "listManagedInstances" and method == "POST":
            return self._managed(g)
        if verb == "resizeRequests" and method == "POST":
            req = dict(body or {})
            if not req.get("name") or int(req.get("resizeBy", 0)) < 1:
                raise Refused(400, "INVALID_ARGUMENT", "A resize request needs a name and resizeBy >= 1", "invalid")
            if any(r["name"] == req["name"] for r in g.resize_requests):
                raise Refused(409, "ALREADY_EXISTS", f"The resize request '{req['name']}' already exists",
                              "alreadyExists")
            g.resize_requests.append({**req, "state": "ACCEPTED", "created": self.clock()})
            self._set_target(g, g.target_size + int(req["resizeBy"]))
            return self._operation("compute.instanceGroupManagerResizeRequests.insert", location, target)
        if verb == "resizeRequests" and method == "GET":
            return {"items": [{k: v for k, v in r.items() if k != "created"} for r in g.resize_requests]}
        raise _not_found(f"{target}/{'/'.join(tail[1:])}")

    def _instance(self, method: str, zone: str, tail: list[str]) -> Any:
        inst = self._find_instance(zone, tail[0])
        target = f"zones/{zone}/instances/{inst.name}"
        if len(tail) == 1 and method == "GET":
            return {"kind": "compute#instance", "name": inst.name, "status": inst.status,
                    "zone": f"{self.compute_api}/projects/{self.project}/zones/{zone}",
                    "scheduling": {"provisioningModel": inst.provisioning}}
        if len(tail) == 2 and tail[1] in ("stop", "start") and method == "POST":
            inst.status = "TERMINATED" if tail[1] == "stop" else "RUNNING"
            return self._operation(f"compute.instances.{tail[1]}", f"zones/{zone}", target)
        raise _not_found(f"projects/{self.project}/{target}/{'/'.join(tail[1:])}")

    def _advice(self, region: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.regions.get(region)
        if r is None:
            raise _not_found(f"projects/{self.project}/regions/{region}")
        model = body.get("instanceProperties", {}).get("scheduling", {}).get("provisioningModel", "STANDARD")
        selections = body.get("instanceFlexibilityPolicy", {}).get("instanceSelections", {})
        types = [t for s in selections.values() for t in s.get("machineTypes", [])]
        if not types:
            raise Refused(400, "INVALID_ARGUMENT", "instanceFlexibilityPolicy.instanceSelections is required",
                          "required")
        zones = [z["zone"].rsplit("/", 1)[-1] for z in body.get("distributionPolicy", {}).get("zones", [])] \
            or list(r["zones"])
        scored = [(self._obtainability(z, model, t), z, t) for z in zones for t in types]
        best, zone, mt = max(scored)
        return {"recommendations": [{
            "scores": {"obtainability": round(best, 3), "estimatedUptime": "3600s"},
            "shards": [{"zone": f"zones/{zone}", "machineType": mt, "instanceCount": int(body.get("size", 1)),
                        "provisioningModel": model}]}]}

    def _serviceusage(self, method: str, rest: str, query: dict[str, list[str]]) -> Any:
        m = re.fullmatch(r"projects/([^/]+)/services:batchGet", rest)
        if m and method == "GET":
            return {"services": [self._service(m.group(1), n.rsplit("/", 1)[-1]) for n in query.get("names", [])]}
        m = re.fullmatch(r"projects/([^/]+)/services/([^/]+)", rest)
        if m and method == "GET":
            return self._service(m.group(1), m.group(2))
        raise _not_found(rest)

    def _service(self, project: str, name: str) -> dict[str, Any]:
        if project not in (self.project, "424242"):
            raise Refused(403, "PERMISSION_DENIED", f"Permission denied on project {project}", "forbidden")
        return {"name": f"projects/424242/services/{name}", "parent": "projects/424242",
                "state": self.services.get(name, "DISABLED")}

    def token_grant(self, form: dict[str, list[str]]) -> tuple[int, Any]:
        """OAuth 2.0 token endpoint: a refresh-token grant (user ADC) or a JWT-bearer grant (a
        service-account key, whose `token_uri` google-auth honours), for a known principal."""
        with self._lock:
            self.calls.append(Call("POST", "/token", {}, {k: "..." for k in form}))
            grant = form.get("grant_type", [""])[0]
            granted = False
            if grant == "refresh_token":
                granted = form.get("refresh_token", [""])[0] in self.refresh_tokens
            elif grant == "urn:ietf:params:oauth:grant-type:jwt-bearer":
                granted = _jwt_issuer(form.get("assertion", [""])[0]) in self.service_accounts
            if granted:
                return 200, {"access_token": self.token, "expires_in": 3599, "token_type": "Bearer",
                             "scope": "https://www.googleapis.com/auth/cloud-platform"}
            return 400, {"error": "invalid_grant", "error_description": "Bad Request"}


def _jwt_issuer(assertion: str) -> str | None:
    import base64

    try:
        payload = assertion.split(".")[1]
        return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))).get("iss")
    except (IndexError, ValueError, AttributeError):
        return None


class _Handler(BaseHTTPRequestHandler):
    gcp: FakeGcp
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass  # `FakeGcp.calls` is the record

    def _send(self, status: int, answer: Any) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self) -> None:
        url = urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if url.path == "/token" and self.command == "POST":
            self._send(*self.gcp.token_grant(parse_qs(raw.decode())))
            return
        if self.headers.get("Authorization") != f"Bearer {self.gcp.token}":
            self._send(HTTPStatus.UNAUTHORIZED, {"error": {
                "code": 401, "status": "UNAUTHENTICATED",
                "message": "Request is missing required authentication credential.",
                "errors": [{"reason": "required", "message": "Login Required", "domain": "global"}]}})
            return
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            self._send(HTTPStatus.BAD_REQUEST, {"error": {"code": 400, "status": "INVALID_ARGUMENT",
                                                          "message": "Invalid JSON payload received."}})
            return
        self._send(*self.gcp.handle(self.command, url.path, parse_qs(url.query), body))

    do_GET = do_POST = do_PATCH = do_DELETE = _serve
