"""Identity and Access Management as Google evaluates it, for the loopback fakes: who may call what.

The fakes (`drill.fake_gcp`) ask `Policy.check(principal, permission, resource)` before every call
they answer, and refuse with 403 and the missing permission when it says no. A `Policy` is read
from a **synthesized stack** (`from_stack`: the cdk.tf.json / `Testing.synth` JSON), so a grant the
stack lacks, or one Google would not honour, fails the tests instead of the first real deploy:

- bindings: `google_project_iam_member` (the project: every resource in it),
  `google_storage_bucket_iam_member` (the bucket and its objects),
  `google_secret_manager_secret_iam_member`, `google_compute_instance_iam_member` and
  `google_cloud_run_v2_job_iam_member` (that one resource), `google_compute_subnetwork_iam_member`;
- roles: the stack's `google_project_iam_custom_role`s (their permissions as written), and the
  predefined roles in `PREDEFINED` (a stack that uses any other predefined role fails to load, so
  the table grows with the stack, from Google's roles reference);
- Terraform references (`${google_service_account.X.email}`, `${google_storage_bucket.X.name}`,
  ...) are resolved from the stack's own resources, the way `apply` would fill them in.

Conditions are evaluated as IAM does (cloud.google.com/iam/docs/conditions-attribute-reference):
the CEL subset the stack writes (`resource.name` / `resource.type` / `resource.service` with `==`,
`!=`, `startsWith()`, `endsWith()`, joined by `&&`, `||`, `!` and parentheses; anything else is an
error, never a guess). The resource attributes exist only for the resource types Google lists
(iam/docs/conditions-resource-attributes): "If part of a condition uses an attribute that isn't
available for a resource, then that part of the condition is never interpreted as granting
access." So for an instance group manager, an operation or a Cloud Run job, `resource.name ==
"..."` is unknown, and a binding whose condition needs it grants nothing (`SUPPORTED_TYPES`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

#: Who `FakeGcp` is when a test says nothing else: the human who deploys (a project Owner).
DEPLOYER = "user:deployer@example.com"

#: The predefined roles the stacks grant, with the permissions of each that the fakes check (the
#: whole role where it is short). Source: the IAM roles reference,
#: https://cloud.google.com/iam/docs/roles-permissions/{compute,storage,secretmanager,run,logging,
#: monitoring} (read 2026-11). `roles/owner` is the deployer's basic role: everything.
PREDEFINED: dict[str, frozenset[str]] = {
    "roles/owner": frozenset({"*"}),
    # Granted on a Cloud Billing account (cloud.google.com/iam/docs/roles-permissions/billing).
    "roles/billing.costsManager": frozenset({"billing.budgets.create", "billing.budgets.delete",
                                             "billing.budgets.get", "billing.budgets.list",
                                             "billing.budgets.update", "billing.accounts.get"}),
    "roles/logging.logWriter": frozenset({"logging.logEntries.create", "logging.logEntries.route"}),
    "roles/monitoring.metricWriter": frozenset({"monitoring.metricDescriptors.create",
                                                "monitoring.metricDescriptors.get",
                                                "monitoring.metricDescriptors.list",
                                                "monitoring.monitoredResourceDescriptors.get",
                                                "monitoring.monitoredResourceDescriptors.list",
                                                "monitoring.timeSeries.create"}),
    "roles/storage.objectAdmin": frozenset({"storage.objects.create", "storage.objects.delete",
                                            "storage.objects.get", "storage.objects.getIamPolicy",
                                            "storage.objects.list", "storage.objects.restore",
                                            "storage.objects.setIamPolicy", "storage.objects.update",
                                            "storage.multipartUploads.create", "storage.multipartUploads.abort",
                                            "storage.multipartUploads.list", "storage.multipartUploads.listParts"}),
    "roles/storage.objectUser": frozenset({"storage.objects.create", "storage.objects.delete",
                                           "storage.objects.get", "storage.objects.list",
                                           "storage.objects.restore", "storage.objects.update",
                                           "storage.multipartUploads.create", "storage.multipartUploads.abort",
                                           "storage.multipartUploads.list", "storage.multipartUploads.listParts"}),
    "roles/storage.objectViewer": frozenset({"storage.objects.get", "storage.objects.list",
                                             "storage.folders.get", "storage.folders.list",
                                             "storage.managedFolders.get", "storage.managedFolders.list"}),
    "roles/secretmanager.secretAccessor": frozenset({"secretmanager.versions.access"}),
    "roles/secretmanager.secretVersionAdder": frozenset({"secretmanager.versions.add"}),
    # Read-only on every Compute resource of the project: the subset the fakes serve.
    "roles/compute.viewer": frozenset({"compute.advice.capacity", "compute.images.get",
                                       "compute.images.getFromFamily", "compute.images.list",
                                       "compute.instanceGroupManagers.get", "compute.instanceGroupManagers.list",
                                       "compute.instances.get", "compute.instances.list",
                                       "compute.machineTypes.get", "compute.machineTypes.list",
                                       "compute.projects.get", "compute.regionOperations.get",
                                       "compute.regionOperations.list", "compute.regions.get",
                                       "compute.regions.list", "compute.zoneOperations.get",
                                       "compute.zoneOperations.list", "compute.zones.get",
                                       "compute.zones.list"}),
    "roles/compute.networkUser": frozenset({"compute.networks.get", "compute.networks.list",
                                            "compute.networks.use", "compute.networks.useExternalIp",
                                            "compute.subnetworks.get", "compute.subnetworks.list",
                                            "compute.subnetworks.use", "compute.subnetworks.useExternalIp"}),
    "roles/run.invoker": frozenset({"run.jobs.run", "run.routes.invoke"}),
}

#: Resource types whose requests carry `resource.type` and `resource.name` for conditions
#: (iam/docs/conditions-resource-attributes, "Resource type values", the services the stacks
#: touch). Not listed, so never matched by a name or type condition: compute.googleapis.com/
#: InstanceGroupManager and RegionInstanceGroupManager, Compute operations, Cloud Run jobs.
SUPPORTED_TYPES = frozenset({
    "compute.googleapis.com/BackendService", "compute.googleapis.com/Disk",
    "compute.googleapis.com/Firewall", "compute.googleapis.com/ForwardingRule",
    "compute.googleapis.com/GlobalForwardingRule", "compute.googleapis.com/Image",
    "compute.googleapis.com/Instance", "compute.googleapis.com/InstanceTemplate",
    "compute.googleapis.com/Snapshot", "compute.googleapis.com/TargetHttpProxy",
    "compute.googleapis.com/TargetHttpsProxy", "compute.googleapis.com/TargetSslProxy",
    "compute.googleapis.com/TargetTcpProxy",
    "storage.googleapis.com/Bucket", "storage.googleapis.com/ManagedFolder", "storage.googleapis.com/Object",
    "secretmanager.googleapis.com/Secret", "secretmanager.googleapis.com/SecretVersion",
    "cloudresourcemanager.googleapis.com/Project",
})
#: Services whose requests carry `resource.service` (same page, "Resource service values").
SUPPORTED_SERVICES = frozenset({"compute.googleapis.com", "storage.googleapis.com",
                                "secretmanager.googleapis.com", "cloudresourcemanager.googleapis.com"})


class PolicyError(ValueError):
    """The stack holds something this model cannot evaluate (an unknown predefined role, a
    condition outside the CEL subset, an unresolvable reference): fix the model, never guess."""


@dataclass(frozen=True)
class Resource:
    """The target of a call as IAM sees it: service, type, relative name, and the resources
    above it whose allow policies it inherits (the project always, the bucket of an object)."""

    service: str
    type: str
    name: str
    parents: tuple[str, ...] = ()

    def nodes(self) -> tuple[str, ...]:
        return (*self.parents, self.name)


@dataclass(frozen=True)
class Binding:
    member: str
    role: str
    on: str  # the resource whose allow policy holds it: projects/P, projects/_/buckets/B, ...
    condition: str | None = None
    source: str = ""  # the Terraform address, for messages


@dataclass
class Policy:
    bindings: list[Binding] = field(default_factory=list)
    custom_roles: dict[str, frozenset[str]] = field(default_factory=dict)

    def grant(self, member: str, role: str, on: str, condition: str | None = None) -> "Policy":
        self.permissions(role)  # an unknown role fails here, not at the first call
        if condition is not None:
            Condition(condition)
        self.bindings.append(Binding(member, role, on, condition, "grant()"))
        return self

    def permissions(self, role: str) -> frozenset[str]:
        if role in self.custom_roles:
            return self.custom_roles[role]
        if role in PREDEFINED:
            return PREDEFINED[role]
        raise PolicyError(f"role {role!r} is neither a custom role of the stack nor in drill.iam.PREDEFINED "
                          "(add it there with its permissions from Google's roles reference)")

    def allows(self, member: str, permission: str, resource: Resource) -> bool:
        nodes = set(resource.nodes())
        for b in self.bindings:
            if b.on not in nodes or b.member not in (member, "allAuthenticatedUsers", "allUsers"):
                continue
            perms = self.permissions(b.role)
            if permission not in perms and "*" not in perms:
                continue
            if b.condition is None or Condition(b.condition).grants(resource):
                return True
        return False

    def members(self) -> set[str]:
        return {b.member for b in self.bindings}

    # --- from a synthesized stack ----------------------------------------------------------
    @classmethod
    def from_stack(cls, stack: dict[str, Any] | str) -> "Policy":
        doc = json.loads(stack) if isinstance(stack, str) else stack
        resources: dict[str, dict[str, Any]] = doc.get("resource", {})
        ref = _Resolver(resources)
        policy = cls()
        for key, role in resources.get("google_project_iam_custom_role", {}).items():
            name = ref.value("google_project_iam_custom_role", key, "name")
            policy.custom_roles[name] = frozenset(role["permissions"])
        kinds = {
            "google_project_iam_member": lambda r: f"projects/{ref(r['project'])}",
            "google_storage_bucket_iam_member": lambda r: f"projects/_/buckets/{ref(r['bucket'])}",
            "google_secret_manager_secret_iam_member":
                lambda r: f"projects/{ref(r['project'])}/secrets/{ref(r['secret_id'])}",
            "google_compute_instance_iam_member":
                lambda r: f"projects/{ref(r['project'])}/zones/{ref(r['zone'])}/instances/{ref(r['instance_name'])}",
            "google_cloud_run_v2_job_iam_member":
                lambda r: f"projects/{ref(r['project'])}/locations/{ref(r['location'])}/jobs/{ref(r['name'])}",
            "google_compute_subnetwork_iam_member":
                lambda r: f"projects/{ref(r['project'])}/regions/{ref(r['region'])}/subnetworks/{ref(r['subnetwork'])}",
        }
        for kind in resources:
            if "_iam_" in kind and kind not in kinds and kind != "google_project_iam_custom_role":
                raise PolicyError(f"{kind}: an IAM resource drill.iam does not read yet")
        for kind, where in kinds.items():
            for key, r in resources.get(kind, {}).items():
                cond = r.get("condition")
                expression = ref(cond["expression"]) if cond else None
                b = Binding(ref(r["member"]), ref(r["role"]), where(r), expression, f"{kind}.{key}")
                policy.permissions(b.role)
                if expression is not None:
                    Condition(expression)
                policy.bindings.append(b)
        return policy


class _Resolver:
    """`${TYPE.ID.ATTR}` -> the value `apply` would give it, from the stack's own resources."""

    _REF = re.compile(r"\$\{([a-z0-9_]+)\.([A-Za-z0-9_-]+)\.([a-z_]+)\}")

    def __init__(self, resources: dict[str, dict[str, Any]]) -> None:
        self.resources = resources

    def __call__(self, text: str) -> str:
        return self._REF.sub(lambda m: self.value(m.group(1), m.group(2), m.group(3)), str(text))

    def value(self, kind: str, key: str, attr: str) -> str:
        try:
            r = self.resources[kind][key]
        except KeyError:
            raise PolicyError(f"${{{kind}.{key}.{attr}}}: no such resource in the stack") from None
        if kind == "google_service_account" and attr == "email":
            return f"{self(r['account_id'])}@{self(r['project'])}.iam.gserviceaccount.com"
        if kind == "google_project_iam_custom_role" and attr == "name":
            return f"projects/{self(r['project'])}/roles/{self(r['role_id'])}"
        if attr in r and isinstance(r[attr], str):
            return self(r[attr])
        raise PolicyError(f"${{{kind}.{key}.{attr}}}: cannot be resolved before apply")


# --- conditions: the CEL subset, with IAM's "unavailable attribute" rule ------------------------
UNKNOWN = object()  # an attribute the resource does not provide, and what it taints
_TOKEN = re.compile(r"\s*(?:(?P<str>\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*')|(?P<op>&&|\|\||==|!=|!|\(|\)|,|\.)"
                    r"|(?P<id>[A-Za-z_][A-Za-z0-9_]*))")


class Condition:
    """One condition expression, parsed once; `grants(resource)` is True only when it evaluates
    to true (false and unknown both grant nothing)."""

    def __init__(self, expression: str) -> None:
        self.expression = expression
        self.tokens = self._lex(expression)
        self.pos = 0
        self.tree = self._or()
        if self.pos != len(self.tokens):
            raise PolicyError(f"condition {expression!r}: unexpected {self.tokens[self.pos][1]!r}")

    def grants(self, resource: Resource) -> bool:
        return _eval(self.tree, resource) is True

    # recursive descent: or := and ('||' and)*; and := unary ('&&' unary)*;
    # unary := '!' unary | primary; primary := '(' or ')' | comparison | call
    def _lex(self, text: str) -> list[tuple[str, str]]:
        out, i = [], 0
        while i < len(text):
            if text[i:].strip() == "":
                break
            m = _TOKEN.match(text, i)
            if m is None or m.end() == i:
                raise PolicyError(f"condition {text!r}: cannot read {text[i:i + 20]!r}")
            kind = m.lastgroup or ""
            value = m.group(kind)
            out.append((kind, json.loads(value) if kind == "str" and value[0] == '"'
                        else value[1:-1] if kind == "str" else value))
            i = m.end()
        return out

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, value: str | None = None, kind: str | None = None) -> str:
        tok = self._peek()
        if tok is None or (value is not None and tok[1] != value) or (kind is not None and tok[0] != kind):
            raise PolicyError(f"condition {self.expression!r}: expected {value or kind}, got {tok}")
        self.pos += 1
        return tok[1]

    def _or(self) -> Any:
        node = self._and()
        while self._peek() == ("op", "||"):
            self._take("||")
            node = ("or", node, self._and())
        return node

    def _and(self) -> Any:
        node = self._unary()
        while self._peek() == ("op", "&&"):
            self._take("&&")
            node = ("and", node, self._unary())
        return node

    def _unary(self) -> Any:
        if self._peek() == ("op", "!"):
            self._take("!")
            return ("not", self._unary())
        if self._peek() == ("op", "("):
            self._take("(")
            node = self._or()
            self._take(")")
            return node
        attr = self._attribute()
        if self._peek() == ("op", "."):
            self._take(".")
            method = self._take(kind="id")
            if method not in ("startsWith", "endsWith"):
                raise PolicyError(f"condition {self.expression!r}: {method}() is not in the subset drill.iam reads")
            self._take("(")
            arg = self._take(kind="str")
            self._take(")")
            return (method, attr, arg)
        op = self._take(kind="op")
        if op not in ("==", "!="):
            raise PolicyError(f"condition {self.expression!r}: operator {op!r} is not in the subset drill.iam reads")
        return (op, attr, self._take(kind="str"))

    def _attribute(self) -> str:
        first = self._take(kind="id")
        self._take(".")
        second = self._take(kind="id")
        name = f"{first}.{second}"
        if name not in ("resource.name", "resource.type", "resource.service"):
            raise PolicyError(f"condition {self.expression!r}: attribute {name} is not in the subset drill.iam reads")
        return name


def _attribute(name: str, r: Resource) -> Any:
    if name == "resource.service":
        return r.service if r.service in SUPPORTED_SERVICES else UNKNOWN
    if r.type not in SUPPORTED_TYPES:
        return UNKNOWN
    return r.type if name == "resource.type" else r.name


def _eval(node: Any, r: Resource) -> Any:
    """CEL's commutative logic with IAM's rule: an unavailable attribute never grants access."""
    kind = node[0]
    if kind == "or":
        a, b = _eval(node[1], r), _eval(node[2], r)
        return True if True in (a, b) else UNKNOWN if UNKNOWN in (a, b) else False
    if kind == "and":
        a, b = _eval(node[1], r), _eval(node[2], r)
        return False if False in (a, b) else UNKNOWN if UNKNOWN in (a, b) else True
    if kind == "not":
        a = _eval(node[1], r)
        return UNKNOWN if a is UNKNOWN else not a
    value = _attribute(node[1], r)
    if value is UNKNOWN:
        return UNKNOWN
    if kind == "==":
        return value == node[2]
    if kind == "!=":
        return value != node[2]
    if kind == "startsWith":
        return value.startswith(node[2])
    return value.endswith(node[2])


def storage_checks(method: str, path: str, body: bytes, exists: Callable[[str, str], bool],
                   project: Callable[[str], str]) -> list[tuple[str, Resource]]:
    """What Cloud Storage checks for one JSON API request (storage/docs/json_api, and
    storage/docs/access-control/iam-json): reads `storage.objects.get`, listing
    `storage.objects.list` on the bucket, an upload `storage.objects.create` and, when it replaces
    an object, `storage.objects.delete` too; a compose `storage.objects.create`, `storage.objects.get`
    on every source (and the delete when it replaces an object); deletes and metadata updates their own. A request
    this model does not know is an error, never allowed by default."""
    from urllib.parse import parse_qs, unquote, urlsplit

    u = urlsplit(path)
    q = parse_qs(u.query)
    parts = [unquote(x) for x in u.path.strip("/").split("/")]

    def bucket(b: str) -> Resource:
        return Resource("storage.googleapis.com", "storage.googleapis.com/Bucket", f"projects/_/buckets/{b}",
                        (f"projects/{project(b)}",))

    def obj(b: str, name: str) -> Resource:
        return Resource("storage.googleapis.com", "storage.googleapis.com/Object",
                        f"projects/_/buckets/{b}/objects/{name}", (f"projects/{project(b)}", f"projects/_/buckets/{b}"))

    if parts[:3] == ["upload", "storage", "v1"] and parts[3:4] == ["b"] and parts[5:] == ["o"]:
        b = parts[4]
        if method == "PUT" or q.get("upload_id"):
            return []  # a resumable upload's data: checked when the session was started
        name = q.get("name", [None])[0]
        if name is None:
            m = re.search(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body[:65536])
            name = json.loads(b'"' + m.group(1) + b'"') if m else None
        if method != "POST" or name is None:
            raise PolicyError(f"storage request not modelled: {method} {path}")
        checks = [("storage.objects.create", obj(b, name))]
        if q.get("ifGenerationMatch", [None])[0] != "0" and exists(b, name):
            checks.append(("storage.objects.delete", obj(b, name)))  # an overwrite replaces it
        return checks
    if parts[:1] == ["download"]:
        parts = parts[1:]
    if parts[:3] == ["storage", "v1", "b"] and len(parts) >= 4:
        b, rest = parts[3], parts[4:]
        if not rest and method == "GET":
            return [("storage.buckets.get", bucket(b))]
        if rest == ["o"] and method == "GET":
            return [("storage.objects.list", bucket(b))]
        if rest[:1] == ["o"] and len(rest) >= 3 and rest[-1] == "compose" and method == "POST":
            # Compose: create the object, read every source, and replace what is there.
            name = "/".join(rest[1:-1])
            try:
                sources = [str(src["name"]) for src in json.loads(body or b"{}").get("sourceObjects") or []]
            except (ValueError, TypeError, KeyError) as e:
                raise PolicyError(f"storage compose not modelled: {method} {path}: {e}") from None
            checks = [("storage.objects.create", obj(b, name))]
            checks += [("storage.objects.get", obj(b, src)) for src in sources]
            if q.get("ifGenerationMatch", [None])[0] != "0" and exists(b, name):
                checks.append(("storage.objects.delete", obj(b, name)))
            return checks
        if rest[:1] == ["o"] and len(rest) >= 2:
            name = "/".join(rest[1:])
            verb = {"GET": "get", "DELETE": "delete", "PATCH": "update", "PUT": "update"}.get(method)
            if verb is not None:
                return [(f"storage.objects.{verb}", obj(b, name))]
    raise PolicyError(f"storage request not modelled: {method} {path}")


def service_account(email: str) -> str:
    return f"serviceAccount:{email}"


def accounts(stack: dict[str, Any]) -> dict[str, str]:
    """account_id -> email of every service account the stack creates."""
    ref = _Resolver(stack.get("resource", {}))
    return {ref(r["account_id"]): ref.value("google_service_account", key, "email")
            for key, r in stack.get("resource", {}).get("google_service_account", {}).items()}


def missing(policy: Policy, member: str, checks: Iterable[tuple[str, Resource]]) -> list[str]:
    """The (permission on resource) lines of `checks` that `member` is not granted."""
    return [f"{p} on {r.name}" for p, r in checks if not policy.allows(member, p, r)]
