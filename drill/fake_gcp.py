"""A fake of the Google Cloud REST APIs our own code calls, on loopback, speaking the real protocol.

What cannot exist here is faked, and only that: the Compute Engine API (the part the control job,
the capacity check and `make preflight` use), Cloud Run's `jobs.run` (how a VM starts its
experiment's control job), the Service Usage API, Secret Manager (the experiment's checkpoint key,
`trainer.checkpoint_key`), and the OAuth 2.0 token endpoint that application-default credentials
refresh against. Clients talk plain HTTP with the real paths and JSON bodies, pointed here by their
endpoint settings (`SPOTTRAIN_COMPUTE_API`, `SPOTTRAIN_RUN_API`, `SPOTTRAIN_SERVICEUSAGE_API`,
`SPOTTRAIN_SECRETMANAGER_API`, an ADC file's `token_uri`).

It is never kinder than Google:

- **Identity and IAM on every call.** A bearer token names a principal (`add_identity`; the
  constructor's `token` is the deployer, a project Owner); an unknown token is 401. Each call is
  checked against `policy` (`drill.iam.Policy`, read from the synthesized stack) for the permission
  Google's REST reference names for that method, on the resource IAM sees (an instance group
  manager, an instance, an operation, a secret version, a Cloud Run job...), with conditions
  evaluated as IAM does: a condition on an attribute the resource type does not provide never
  grants. A refusal is Google's 403 body naming the missing permission (`refusals` keeps them).
- **Operations take time.** A mutation (resize, resize request, instance stop/start) answers an
  Operation that is `PENDING`; every later request the fake answers moves each unfinished
  operation one step (`PENDING` -> `RUNNING` -> `DONE`), and `tick()` (a simulated clock moving on)
  finishes them all. The resource changes only when its operation is `DONE` (a group's
  `targetSize`, an instance's `TERMINATED`; `STOPPING` while the stop runs), as
  compute/docs/reference/rest/v1/instanceGroupManagers/resize says: "The resize operation is marked
  DONE when the resize actions are scheduled". `zoneOperations.wait` returns the operation's
  current state, done or not ("Be prepared to retry if the operation is not DONE"). So a client
  must poll something, and only what its grants allow.

Protocol kept (cloud.google.com/compute/docs/reference/rest/v1, /run/docs/reference/rest,
/serviceusage/docs/reference/rest, /secret-manager/docs/reference/rest):
- errors are Google's JSON error `{"error": {"code", "message", "status", "errors": [...]}}`;
- `instanceGroupManagers` and `regionInstanceGroupManagers`: get, resize (`?size=N`),
  listManagedInstances, resizeRequests insert/list/get (flex-start);
- `instances` get/stop/start; `zoneOperations`/`regionOperations` get and wait;
- `regions.get` (status, zones, quotas), `machineTypes.get` per zone, `images.getFromFamily`
  (public image projects: any authenticated caller), `regions/{r}/advice/capacity` (beta and v1);
- Cloud Run v2 `POST .../locations/R/jobs/J:run`: an execution of the job (`job_runner`, if set,
  is called with the job's name and runs it the way the test or drill wants) and its long-running
  operation;
- Resource Manager `projects.testIamPermissions` and Cloud Billing `billingAccounts.testIamPermissions`
  (a billing account's permissions only from bindings on the account: a project Owner has none);
- Service Usage `services.get` and `services:batchGet`; `POST /token` (refresh-token and JWT-bearer
  grants, both for the deployer);
- Secret Manager `secrets.addVersion` and `secrets.versions.access` (versions numbered from 1; 404
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
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from drill.iam import DEPLOYER, Policy, Resource
from drill.quiet_http import QuietHTTPServer

COMPUTE_PREFIXES = ("/compute/v1/", "/compute/beta/")
SERVICEUSAGE_PREFIX = "/v1/"
RUN_PREFIX = "/v2/"
#: Image projects whose images any authenticated caller may read (Google's public images).
PUBLIC_IMAGE_PROJECTS = ("deeplearning-platform-release", "debian-cloud", "ubuntu-os-cloud", "cos-cloud")


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
    #: Compute's unique id (a uint64 as a string): a VM the group recreates under the same name
    #: gets a new one, as on Google, so a record bound to an id tells incarnations apart.
    id: str = field(default_factory=lambda: str(uuid.uuid4().int >> 65))


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
    status: str = "PENDING"  # PENDING, RUNNING, DONE
    error: dict[str, Any] | None = None
    #: What the operation does: `on_running` when it starts, `on_done` when it completes.
    on_running: Callable[[], None] | None = field(default=None, repr=False)
    on_done: Callable[[], None] | None = field(default=None, repr=False)

    def step(self) -> None:
        if self.status == "PENDING":
            self.status = "RUNNING"
            if self.on_running is not None:
                self.on_running()
        elif self.status == "RUNNING":
            self.status = "DONE"
            if self.on_done is not None:
                self.on_done()


@dataclass
class Call:
    """One request as the fake saw it (for tests and reports)."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    status: int = 0
    principal: str = ""


class FakeGcp:
    """The fake APIs of one project; a context manager. `clock` defaults to wall time.

    `token` is the deployer's (a project Owner, as whoever runs `make preflight` or `cdktn deploy`);
    other callers are added with `add_identity(token, principal)`. `policy` holds every other grant,
    typically `drill.iam.Policy.from_stack(...)` of the experiment's synthesized stack."""

    def __init__(self, project: str = "spottrain-drill", *, clock: Callable[[], float] | None = None,
                 token: str = "fake-access-token", policy: Policy | None = None) -> None:
        self.project = project
        self.clock = clock or time.time
        self.policy = policy if policy is not None else Policy()
        self.policy.grant(DEPLOYER, "roles/owner", f"projects/{project}")
        self.identities: dict[str, str] = {}
        self.token = token
        self._lock = threading.Condition()
        self.groups: dict[str, Group] = {}
        self.standalone: dict[tuple[str, str], Instance] = {}  # (zone, name): not in a group
        self.operations: dict[str, Operation] = {}
        self._op_seq = itertools.count(1)
        self.calls: list[Call] = []
        #: Every 403 the IAM model answered: (principal, permission, resource name)
        self.refusals: list[tuple[str, str, str]] = []
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
        #: grant still propagating (the model's own refusals come from `policy`)
        self.denied: list[list[Any]] = []
        #: Secret Manager: secret resource name -> versions (1-based), each {"data", "state"}
        self.secrets: dict[str, list[dict[str, Any]]] = {}
        #: Cloud Run jobs: "projects/P/locations/R/jobs/J" -> executions started
        self.jobs: dict[str, list[str]] = {}
        #: Called (on a thread of its own) with the job's name for every execution `jobs.run`
        #: starts; None: executions are only recorded.
        self.job_runner: Callable[[str], None] | None = None
        self.refresh_tokens: set[str] = set()
        self.service_accounts: set[str] = set()  # emails whose signed JWTs the token endpoint accepts
        self.preemptions: list[tuple[float, str, str]] = []  # (time, group, instance) of auto groups
        self._httpd: QuietHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._runners: list[threading.Thread] = []

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> "FakeGcp":
        fake = self

        class Handler(_Handler):
            gcp = fake

        self._httpd = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-gcp", daemon=True)
        self._thread.start()
        return self

    def join_jobs(self, timeout: float = 600.0) -> None:
        """Wait until every job execution started so far has ended."""
        for runner in list(self._runners):
            runner.join(timeout=timeout)

    def stop(self) -> None:
        self.join_jobs()
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
    def run_api(self) -> str:
        """The value for SPOTTRAIN_RUN_API (what https://run.googleapis.com/v2 is)."""
        return f"{self.url}/v2"

    @property
    def serviceusage_api(self) -> str:
        return f"{self.url}/v1"

    @property
    def crm_api(self) -> str:
        """The value for SPOTTRAIN_CRM_API (what https://cloudresourcemanager.googleapis.com/v1 is)."""
        return f"{self.url}/v1"

    @property
    def billing_api(self) -> str:
        """The value for SPOTTRAIN_BILLING_API (what https://cloudbilling.googleapis.com/v1 is)."""
        return f"{self.url}/v1"

    @property
    def secretmanager_api(self) -> str:
        """The value for SPOTTRAIN_SECRETMANAGER_API (what https://secretmanager.googleapis.com/v1 is)."""
        return f"{self.url}/v1"

    @property
    def token_uri(self) -> str:
        return f"{self.url}/token"

    def key_file(self, path: Path, email: str) -> Path:
        """Application-default credentials for ``email`` at ``path`` (GOOGLE_APPLICATION_CREDENTIALS):
        a service-account key of a fresh RSA key whose ``token_uri`` is this fake's (google-auth pins
        user credentials to Google's endpoint, but honours a key file's), the account known here, so
        ADC signs a JWT and trades it at `token_grant` for the deployer's token."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
        self.service_accounts.add(email)
        path.write_text(json.dumps({"type": "service_account", "project_id": self.project, "private_key_id": "k1",
                                    "private_key": pem, "client_email": email, "client_id": "1",
                                    "token_uri": self.token_uri}))
        return path

    @property
    def token(self) -> str:
        """The deployer's token (the Owner's); setting it replaces the deployer's old one."""
        return self._token

    @token.setter
    def token(self, value: str) -> None:
        self.identities = {t: p for t, p in self.identities.items() if p != DEPLOYER}
        self.identities[value] = DEPLOYER
        self._token = value

    # --- the world -------------------------------------------------------------------------
    def add_identity(self, token: str, principal: str) -> None:
        """Calls with this bearer token come from `principal` ("serviceAccount:EMAIL", "user:...")."""
        with self._lock:
            self.identities[token] = principal

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

    def add_job(self, region: str, name: str) -> str:
        """A Cloud Run job of this project (as the stack creates it); its resource name."""
        job = f"projects/{self.project}/locations/{region}/jobs/{name}"
        with self._lock:
            self.jobs.setdefault(job, [])
        return job

    def deny(self, method: str, path_regex: str, times: int | None = None) -> None:
        """Answer 403 to matching calls whatever the policy says, e.g. deny("POST", "/resize"); with
        `times`, only to that many (a grant that is still propagating)."""
        self.denied.append([method.upper(), path_regex, times])

    def add_secret(self, secret_id: str) -> str:
        """A Secret Manager secret of this project, without versions (as the stack creates it);
        its resource name. Idempotent."""
        name = f"projects/{self.project}/secrets/{secret_id}"
        with self._lock:
            self.secrets.setdefault(name, [])
        return name

    def add_secret_version(self, name: str, data: bytes) -> int:
        """What `secrets.addVersion` does for whoever may call it (a test standing in for the first
        VM's boot); the new version's number."""
        with self._lock:
            self.secrets[name].append({"data": bytes(data), "state": "ENABLED", "created": self.clock()})
            return len(self.secrets[name])

    def recreate(self, group: str, name: str) -> Instance:
        """The group recreated its VM ``name`` (repair after a preemption, or a resize back up): a
        new VM under the same name, with a new id, as on Google."""
        with self._lock:
            g = self.groups[group]
            old = g.instances[name]
            g.instances[name] = Instance(name, old.zone, old.provisioning, created=self.clock(),
                                         machine_type=old.machine_type)
            return g.instances[name]

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

    def instance(self, zone: str, name: str) -> Instance:
        with self._lock:
            return self._find_instance(zone, name)

    def tick(self) -> None:
        """Time passes (the simulation's clock moved on): every operation finishes, and every auto
        group converges on its target at the current `clock()`."""
        with self._lock:
            for op in list(self.operations.values()):
                while op.status != "DONE":
                    op.step()
            for g in self.groups.values():
                self._reconcile(g)
            self._lock.notify_all()

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

    def _operation(self, kind: str, location: str, target: str, *, on_running: Callable[[], None] | None = None,
                   on_done: Callable[[], None] | None = None) -> dict[str, Any]:
        op = Operation(f"operation-{int(self.clock() * 1000)}-{next(self._op_seq):06d}", kind, location, target,
                       on_running=on_running, on_done=on_done)
        self.operations[op.name] = op
        return self._op_json(op)

    def _advance(self) -> None:
        """Time passes by one request: every unfinished operation takes one step."""
        for op in list(self.operations.values()):
            if op.status != "DONE":
                op.step()

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
                  "id": i.id, "name": i.name, "instanceStatus": i.status, "currentAction": "NONE"}
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

    # --- IAM -------------------------------------------------------------------------------
    def storage_gate(self, proxy: Any, buckets: dict[str, str]) -> None:
        """Make `proxy` (a `drill.fault_proxy.FaultProxy` in front of gcp-storage-emulator) check
        every request against this project's policy, for the principal of its bearer token, as
        Cloud Storage does; `buckets`: bucket name -> its project."""
        from drill.iam import PolicyError, storage_checks

        def exists(bucket: str, name: str) -> bool:
            return proxy._generation(bucket, name) is not None

        def authorize(method: str, path: str, headers: dict[str, str], body: bytes) -> str | None:
            auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
            principal = self.identities.get(auth[len("Bearer "):]) if auth.startswith("Bearer ") else None
            if principal is None:
                return "Anonymous caller does not have storage access (no token this project knows)."
            try:
                checks = storage_checks(method, path, body, exists, lambda b: buckets.get(b, "unknown-project"))
            except PolicyError as e:
                return str(e)
            for permission, resource in checks:
                if not self.policy.allows(principal, permission, resource):
                    with self._lock:
                        self.refusals.append((principal, permission, resource.name))
                    who = principal.split(":", 1)[-1]
                    return f"{who} does not have {permission} access to the Google Cloud Storage object or bucket."
            return None

        proxy.authorize = authorize

    def _authorize(self, principal: str, permission: str, resource: Resource, message: str) -> None:
        if not self.policy.allows(principal, permission, resource):
            self.refusals.append((principal, permission, resource.name))
            raise Refused(403, "PERMISSION_DENIED", message, "forbidden")

    def _compute_check(self, principal: str, permission: str, kind: str, name: str) -> None:
        """Compute's own wording: "Required 'PERMISSION' permission for 'RESOURCE'"."""
        self._authorize(principal, permission,
                        Resource("compute.googleapis.com", f"compute.googleapis.com/{kind}", name,
                                 (f"projects/{self.project}",)),
                        f"Required '{permission}' permission for '{name}'")

    # --- request dispatch ------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any,
               principal: str = DEPLOYER) -> tuple[int, Any]:
        with self._lock:
            call = Call(method, path, query, body, principal=principal)
            self.calls.append(call)
            self._advance()
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
                status, answer = 200, self._dispatch(method, path, query, body, principal)
            except Refused as e:
                status = e.code
                answer = {"error": {"code": e.code, "message": e.message, "status": e.status,
                                    "errors": [{"reason": e.reason, "message": e.message, "domain": "global"}]}}
            call.status = status
            self._lock.notify_all()
            return status, answer

    def _dispatch(self, method: str, path: str, query: dict[str, list[str]], body: Any, principal: str) -> Any:
        prefix = next((p for p in COMPUTE_PREFIXES if path.startswith(p)), None)
        if prefix is not None:
            return self._compute(method, path[len(prefix):].strip("/").split("/"), query, body, principal)
        if path.startswith(RUN_PREFIX):
            return self._run(method, path[len(RUN_PREFIX):], principal)
        if path.startswith(SERVICEUSAGE_PREFIX) and path.endswith(":testIamPermissions"):
            return self._test_permissions(method, path[len(SERVICEUSAGE_PREFIX):], body, principal)
        if path.startswith(SERVICEUSAGE_PREFIX) and "/secrets/" in path:
            return self._secretmanager(method, path[len(SERVICEUSAGE_PREFIX):], body, principal)
        if path.startswith(SERVICEUSAGE_PREFIX):
            return self._serviceusage(method, path[len(SERVICEUSAGE_PREFIX):], query, principal)
        raise _not_found(path)

    def _run(self, method: str, rest: str, principal: str) -> Any:
        m = re.fullmatch(r"(projects/([^/]+)/locations/([^/]+)/jobs/([^/:]+)):run", rest)
        if m is None or method != "POST":
            raise _not_found(rest)
        job, project, region = m.group(1), m.group(2), m.group(3)
        self._authorize(principal, "run.jobs.run",
                        Resource("run.googleapis.com", "run.googleapis.com/Job", job, (f"projects/{project}",)),
                        f"Permission 'run.jobs.run' denied on resource '{job}' (or resource may not exist).")
        if job not in self.jobs:
            raise Refused(404, "NOT_FOUND", f"Resource '{m.group(4)}' of kind 'JOB' in region '{region}' in "
                          f"project '{project}' does not exist.", "notFound")
        execution = f"{m.group(4)}-{uuid.uuid4().hex[:5]}"
        self.jobs[job].append(execution)
        if self.job_runner is not None:
            runner = threading.Thread(target=self.job_runner, args=(job,), name=f"job-{execution}", daemon=True)
            self._runners.append(runner)
            runner.start()
        return {"name": f"projects/{project}/locations/{region}/operations/{uuid.uuid4()}",
                "metadata": {"@type": "type.googleapis.com/google.cloud.run.v2.Execution",
                             "name": f"{job}/executions/{execution}", "job": m.group(4)},
                "done": False}

    def _secretmanager(self, method: str, rest: str, body: Any, principal: str) -> Any:
        import base64
        import binascii

        m = re.fullmatch(r"(projects/([^/]+)/secrets/([^/:]+))(?::addVersion|/versions/([^/:]+):access)", rest)
        if m is None:
            raise _not_found(rest)
        name, project, version = m.group(1), m.group(2), m.group(4)
        if rest.endswith(":addVersion"):
            permission, target, kind = "secretmanager.versions.add", name, "Secret"
        else:
            permission, target, kind = "secretmanager.versions.access", f"{name}/versions/{version}", "SecretVersion"
        parents = (f"projects/{project}", name) if kind == "SecretVersion" else (f"projects/{project}",)
        self._authorize(principal, permission,
                        Resource("secretmanager.googleapis.com", f"secretmanager.googleapis.com/{kind}", target,
                                 parents),
                        f"Permission '{permission}' denied for resource '{target}' (or it may not exist).")
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

    def _compute(self, method: str, p: list[str], query: dict[str, list[str]], body: Any, principal: str) -> Any:
        if len(p) < 2 or p[0] != "projects":
            raise _not_found("/".join(p))
        project, rest = p[1], p[2:]
        if rest[:3] == ["global", "images", "family"] and len(rest) == 4 and method == "GET":
            name = f"projects/{project}/global/images/family/{rest[3]}"
            if project not in PUBLIC_IMAGE_PROJECTS:  # a public image: any authenticated caller
                self._compute_check(principal, "compute.images.getFromFamily", "Image", name)
            image = self.images.get((project, rest[3]))
            if image is None:
                raise _not_found(name)
            return {"kind": "compute#image", **image,
                    "selfLink": f"{self.compute_api}/projects/{project}/global/images/{image['name']}"}
        if project != self.project:
            raise Refused(403, "PERMISSION_DENIED", f"Permission denied on project {project}", "forbidden")
        if len(rest) < 2 or rest[0] not in ("zones", "regions"):
            raise _not_found("/".join(p))
        location = f"{rest[0]}/{rest[1]}"
        kind, tail = rest[2:3], rest[3:]
        where = f"projects/{project}/{location}"
        if not kind:
            if rest[0] == "regions" and method == "GET":
                self._compute_check(principal, "compute.regions.get", "Region", where)
                return self._region(rest[1])
            raise _not_found("/".join(p))
        if kind == ["instanceGroupManagers"] and tail:
            return self._igm(method, location, tail, query, body, principal)
        if kind == ["instances"] and tail:
            return self._instance(method, rest[1], tail, principal)
        if kind == ["operations"] and tail:
            family = "zoneOperations" if rest[0] == "zones" else "regionOperations"
            # get and wait both need .get (compute/docs/reference/rest/v1/zoneOperations/wait)
            self._compute_check(principal, f"compute.{family}.get", "Operation", f"{where}/operations/{tail[0]}")
            op = self.operations.get(tail[0])
            if op is None or op.location != location:
                raise _not_found(f"{location}/operations/{tail[0]}")
            return self._op_json(op)
        if kind == ["machineTypes"] and len(tail) == 1 and rest[0] == "zones" and method == "GET":
            self._compute_check(principal, "compute.machineTypes.get", "MachineType", f"{where}/machineTypes/{tail[0]}")
            if tail[0] not in self.machine_types.get(rest[1], set()):
                raise _not_found(f"projects/{project}/zones/{rest[1]}/machineTypes/{tail[0]}")
            return {"kind": "compute#machineType", "name": tail[0], "zone": rest[1]}
        if kind == ["advice"] and tail == ["capacity"] and rest[0] == "regions" and method == "POST":
            self._compute_check(principal, "compute.advice.capacity", "Region", where)
            return self._advice(rest[1], body or {})
        raise _not_found("/".join(p))

    def _region(self, region: str) -> dict[str, Any]:
        r = self.regions.get(region)
        if r is None:
            raise _not_found(f"projects/{self.project}/regions/{region}")
        return {"kind": "compute#region", "name": region, "status": "UP",
                "zones": [f"{self.compute_api}/projects/{self.project}/zones/{z}" for z in r["zones"]],
                "quotas": [{"metric": m, "limit": v, "usage": 0.0} for m, v in sorted(r["quotas"].items())]}

    def _igm(self, method: str, location: str, tail: list[str], query: dict[str, list[str]], body: Any,
             principal: str) -> Any:
        target = f"{location}/instanceGroupManagers/{tail[0]}"
        name = f"projects/{self.project}/{target}"
        verb = tail[1] if len(tail) > 1 else None
        # The permissions of compute/docs/reference/rest/v1/instanceGroupManagers/* (and region*):
        # reads need .get, resize and resize requests .update, all on the group.
        writes = (verb == "resize" and method == "POST") or (verb == "resizeRequests" and method == "POST")
        kind = "RegionInstanceGroupManager" if location.startswith("regions/") else "InstanceGroupManager"
        self._compute_check(principal, f"compute.instanceGroupManagers.{'update' if writes else 'get'}", kind, name)
        g = self.groups.get(tail[0])
        if g is None or g.location != location:
            raise _not_found(name)
        if verb is None and method == "GET":
            return self._group_json(g)
        if verb == "resize" and method == "POST":
            try:
                size = int(query["size"][0])
            except (KeyError, ValueError):
                raise Refused(400, "INVALID_ARGUMENT", "Required 'size' is missing or invalid", "required")
            if size < 0:
                raise Refused(400, "INVALID_ARGUMENT", "Invalid value for field 'size'", "invalid")
            return self._operation("compute.instanceGroupManagers.resize", location, target,
                                   on_done=lambda: self._set_target(g, size))
        if verb == "listManagedInstances" and method == "POST":
            return self._managed(g)
        if verb == "resizeRequests" and method == "POST" and len(tail) == 2:
            req = dict(body or {})
            if not req.get("name") or int(req.get("resizeBy", 0)) < 1:
                raise Refused(400, "INVALID_ARGUMENT", "A resize request needs a name and resizeBy >= 1", "invalid")
            if any(r["name"] == req["name"] for r in g.resize_requests):
                raise Refused(409, "ALREADY_EXISTS", f"The resize request '{req['name']}' already exists",
                              "alreadyExists")

            def accepted() -> None:
                g.resize_requests.append({**req, "state": "ACCEPTED", "created": self.clock()})
                self._set_target(g, g.target_size + int(req["resizeBy"]))

            return self._operation("compute.instanceGroupManagerResizeRequests.insert", location, target,
                                   on_done=accepted)
        if verb == "resizeRequests" and method == "GET" and len(tail) == 2:
            return {"items": [{k: v for k, v in r.items() if k != "created"} for r in g.resize_requests]}
        if verb == "resizeRequests" and method == "GET" and len(tail) == 3:
            found = [r for r in g.resize_requests if r["name"] == tail[2]]
            if not found:
                raise _not_found(f"{name}/resizeRequests/{tail[2]}")
            return {"kind": "compute#instanceGroupManagerResizeRequest",
                    **{k: v for k, v in found[0].items() if k != "created"}}
        raise _not_found(f"{name}/{'/'.join(tail[1:])}")

    def _instance(self, method: str, zone: str, tail: list[str], principal: str) -> Any:
        target = f"zones/{zone}/instances/{tail[0]}"
        name = f"projects/{self.project}/{target}"
        verb = tail[1] if len(tail) == 2 else None
        if len(tail) == 1 and method == "GET":
            permission = "compute.instances.get"
        elif verb in ("stop", "start") and method == "POST":
            permission = f"compute.instances.{verb}"
        else:
            raise _not_found(f"{name}/{'/'.join(tail[1:])}")
        # An instance has an allow policy of its own (a binding on the coordinator is one).
        self._authorize(principal, permission,
                        Resource("compute.googleapis.com", "compute.googleapis.com/Instance", name,
                                 (f"projects/{self.project}",)),
                        f"Required '{permission}' permission for '{name}'")
        inst = self._find_instance(zone, tail[0])
        if verb is None:
            return {"kind": "compute#instance", "id": inst.id, "name": inst.name, "status": inst.status,
                    "zone": f"{self.compute_api}/projects/{self.project}/zones/{zone}",
                    "scheduling": {"provisioningModel": inst.provisioning}}
        if verb == "stop":
            def stopping() -> None:
                if inst.status == "RUNNING":
                    inst.status = "STOPPING"

            def stopped() -> None:
                inst.status = "TERMINATED"

            return self._operation("compute.instances.stop", f"zones/{zone}", target,
                                   on_running=stopping, on_done=stopped)

        def started() -> None:
            inst.status = "RUNNING"

        return self._operation("compute.instances.start", f"zones/{zone}", target, on_done=started)

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

    def _test_permissions(self, method: str, rest: str, body: Any, principal: str) -> Any:
        """`projects.testIamPermissions` (Resource Manager v1) and `billingAccounts.testIamPermissions`
        (Cloud Billing v1): the subset of `permissions` the caller holds on that resource. A billing
        account's permissions come from bindings on the account alone: a project Owner holds none
        of them (cloud.google.com/billing/docs/how-to/billing-access: billing roles are granted on
        the Cloud Billing account; budgets need billing.budgets.create there)."""
        m = re.fullmatch(r"(projects/([^/:]+)|billingAccounts/([0-9A-F]{6}-[0-9A-F]{6}-[0-9A-F]{6})):testIamPermissions",
                         rest)
        if m is None or method != "POST":
            raise _not_found(rest)
        wanted = (body or {}).get("permissions", [])
        if not isinstance(wanted, list) or len(wanted) > 100:  # the documented maximum per request
            raise Refused(400, "INVALID_ARGUMENT", "permissions: at most 100 per request", "badRequest")
        if m.group(2) is not None:
            if m.group(2) != self.project:
                raise Refused(403, "PERMISSION_DENIED", f"Permission denied on project {m.group(2)}", "forbidden")
            target = Resource("cloudresourcemanager.googleapis.com", "cloudresourcemanager.googleapis.com/Project",
                              f"projects/{self.project}")
        else:
            target = Resource("cloudbilling.googleapis.com", "cloudbilling.googleapis.com/BillingAccount", m.group(1))
        return {"permissions": [x for x in wanted if self.policy.allows(principal, x, target)]}

    def _serviceusage(self, method: str, rest: str, query: dict[str, list[str]], principal: str) -> Any:
        m = re.fullmatch(r"projects/([^/]+)/services(?::batchGet|/([^/]+))", rest)
        if m is None or method != "GET":
            raise _not_found(rest)
        project = m.group(1)
        name = f"projects/{self.project if project == '424242' else project}"
        self._authorize(principal, "serviceusage.services.get",
                        Resource("serviceusage.googleapis.com", "serviceusage.googleapis.com/Service", name, ()),
                        f"Permission denied to get service [{rest}]")
        if m.group(2) is None:
            return {"services": [self._service(project, n.rsplit("/", 1)[-1]) for n in query.get("names", [])]}
        return self._service(project, m.group(2))

    def _service(self, project: str, name: str) -> dict[str, Any]:
        if project not in (self.project, "424242"):
            raise Refused(403, "PERMISSION_DENIED", f"Permission denied on project {project}", "forbidden")
        return {"name": f"projects/424242/services/{name}", "parent": "projects/424242",
                "state": self.services.get(name, "DISABLED")}

    def token_grant(self, form: dict[str, list[str]]) -> tuple[int, Any]:
        """OAuth 2.0 token endpoint: a refresh-token grant (user ADC) or a JWT-bearer grant (a
        service-account key, whose `token_uri` google-auth honours), for a known principal: the
        deployer's credentials, so the token is the deployer's."""
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
        auth = self.headers.get("Authorization") or ""
        principal = self.gcp.identities.get(auth[len("Bearer "):]) if auth.startswith("Bearer ") else None
        if principal is None:
            self._send(HTTPStatus.UNAUTHORIZED, {"error": {
                "code": 401, "status": "UNAUTHENTICATED",
                "message": "Request had invalid authentication credentials. Expected OAuth 2 access token, "
                           "login cookie or other valid authentication credential.",
                "errors": [{"reason": "authError", "message": "Invalid Credentials", "domain": "global"}]}})
            return
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            self._send(HTTPStatus.BAD_REQUEST, {"error": {"code": 400, "status": "INVALID_ARGUMENT",
                                                          "message": "Invalid JSON payload received."}})
            return
        self._send(*self.gcp.handle(self.command, url.path, parse_qs(url.query), body, principal))

    do_GET = do_POST = do_PATCH = do_DELETE = _serve
