"""A fake Google Cloud project's inventory: what exists in it, which of it Terraform's state knows,
and what whatever is left costs a month.

- `apply(stack)` creates every resource a synthesized stack declares (the cdk.tf.json /
  `Testing.synth` JSON), keyed by its Terraform address, with the references `apply` would fill
  in resolved: groups, templates, the bucket (a real one, in the project's gcp-storage-emulator,
  holding the stack's code objects), the secret, jobs, service accounts, roles, APIs...
- The groups' VMs come and go as the drill boots and powers off its VM stand-in (`instance_up`,
  `instance_down`) and as the group's target size moves (`resize`, `sync` from the fake Compute
  API). Each VM gets the disks of its group's template, and when the VM goes, each disk goes the
  way Compute Engine takes it (compute/docs/instance-groups/configuring-stateful-disks-in-migs,
  and the template's `disk.auto_delete`):
  * a disk of the group's stateful policy (`stateful_disk.device_name`) stays with the managed
    instance while the group only recreates it (repair after a preemption) and is reattached; when
    the instance is deleted for good (the group shrinks, or the group itself is deleted) it is
    deleted with `delete_rule = "ON_PERMANENT_INSTANCE_DELETION"`, and left behind otherwise;
  * any other disk is deleted with its VM when the template says `auto_delete = true`, and left
    behind, detached, otherwise.
  A disk left behind is in the project and in no Terraform state: nothing ever deletes it, and it
  bills until someone notices.
- `destroy()` is `drill.provider`'s model of the provider's destroy on the state; a deleted group
  takes its managed instances with it (for good).
- `left()`: what still exists, each with its size and monthly cost (`stacks.pricing`: disks from
  stacks/prices.json, Cloud Storage and Secret Manager list prices).
- A budget is created as the Budget API creates it (`_check_budget`): only with
  billing.budgets.create on its billing account (`billing_accounts`: none unless a test grants
  it, as a project Owner has none), email channels only, and no currency but the account's.
- An alert policy is created as Monitoring creates it (`_check_alert_policies`): a condition that
  names a log-based metric (`metric.type="logging.googleapis.com/user/NAME"`, or PromQL's
  `logging_googleapis_com:user_NAME`) is refused with 404 "Cannot find metric(s) that match type
  = ..." unless that metric was created at least `METRIC_VISIBLE_S` (10 minutes) before the
  policy (hashicorp/terraform-provider-google#11102). The apply keeps a clock: a resource is
  created once everything it depends on (`depends_on`, `${...}` references) is, instantly,
  except a resource whose `local-exec` provisioner is `sleep N`: what depends on it starts N seconds later.
- `plan(stack)`: the addresses a plan after the apply would change: the state holds what the API
  answers on read (`read_back`), compared with what the stack declares as the provider compares
  it. A dashboard's JSON comes back without its default values, so one that writes them (a tile
  at `xPos` 0) shows a change at every plan.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drill.gcs_emulator import StorageEmulator
from drill.provider import Destroyed, destroy

GROUP_KINDS = ("google_compute_instance_group_manager", "google_compute_region_instance_group_manager")
TEMPLATE_KINDS = ("google_compute_instance_template", "google_compute_region_instance_template")
#: What a reader calls each kind in the report.
LABELS = {"google_storage_bucket": "storage bucket", "google_secret_manager_secret": "secret",
          "disk": "compute disk", "instance": "compute instance"}
_REF = re.compile(r"\$\{([a-z0-9_]+)\.([A-Za-z0-9_-]+)\.([a-z_]+)\}")
#: How long after a log-based metric's creation Monitoring may still not know it: "If a metric
#: was created recently, it could take up to 10 minutes to become available" (the 404's own text,
#: hashicorp/terraform-provider-google#11102; cloud.google.com/logging/docs/logs-based-metrics).
#: The stand-in refuses for all of it, never kinder than Google.
METRIC_VISIBLE_S = 600.0
_USER_METRIC = re.compile(r'metric\.type\s*=\s*"logging\.googleapis\.com/user/([^"]+)"')
_PROMQL_USER_METRIC = re.compile(r"logging_googleapis_com:user_([A-Za-z0-9_:]+)")
_SLEEP = re.compile(r"sleep (\d+)")


#: Enum values that are their field's default (number 0) in the Dashboard API's protos.
_ENUM_DEFAULTS = re.compile(r"^(?:[A-Z_]+_UNSPECIFIED|REDUCE_NONE|ALIGN_NONE)$")


def _without_defaults(value: Any, in_map: bool = False) -> Any:
    """A proto3 message as its JSON mapping prints it: fields at their default value (0, false,
    "", [], an enum's 0 value) are omitted (protobuf.dev/programming-guides/json: "If a field has
    the default value ... it is omitted"); a map keeps every entry, empty values too."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            v = _without_defaults(v, in_map=k == "labels")
            if not in_map and (v is None or v == [] or v == {} or v is False or v == "" or
                               (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0) or
                               (isinstance(v, str) and _ENUM_DEFAULTS.match(v))):
                continue
            out[k] = v
        return out
    if isinstance(value, list):
        return [_without_defaults(v) for v in value]
    return value


def read_back(kind: str, attrs: dict[str, Any]) -> dict[str, Any]:
    """What the provider's refresh reads back into the state. Monitoring's `projects.dashboards.get`
    answers the dashboard without its default-valued fields (chainguard-dev/common's
    modules/dashboard/json strips `"xPos":0`, `"yPos":0`, `"collapsed":false`, `"REDUCE_NONE"` for
    exactly this reason); everything else comes back as written."""
    if kind == "google_monitoring_dashboard" and isinstance(attrs.get("dashboard_json"), str):
        body = json.loads(attrs["dashboard_json"].replace("$${", "${"))
        return {**attrs, "dashboard_json": json.dumps(_without_defaults(body), sort_keys=True).replace("${", "$${")}
    return attrs


def _dashboard_same(old: str, new: str) -> bool:
    """The provider's `monitoringDashboardDiffSuppress` (terraform-provider-google,
    services/monitoring/resource_monitoring_dashboard.go): keys the API added on read (in the
    state, not in the configuration) are removed from the state's JSON, then the two must be
    equal. A key only the configuration has (a default the API dropped) is a change."""
    def computed_removed(o: Any, n: Any) -> Any:
        if isinstance(o, dict) and isinstance(n, dict):
            return {k: computed_removed(v, n[k]) for k, v in o.items() if k in n}
        if isinstance(o, list) and isinstance(n, list) and len(o) == len(n):
            return [computed_removed(a, b) for a, b in zip(o, n)]
        return o
    o, n = json.loads(old), json.loads(new)
    return computed_removed(o, n) == n


class ProjectError(Exception):
    """The stack holds something the fake project cannot create as Google would."""


@dataclass
class Thing:
    """One resource in the project. `address`: the Terraform address while a state knows it."""

    kind: str  # a Terraform resource type, or "instance" / "disk" for what a group creates
    name: str
    attrs: dict[str, Any]
    address: str | None = None
    location: str = ""  # zone or region
    size_gb: float | None = None
    disk_type: str = ""
    attached_to: str | None = None  # a disk's VM

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.location}/{self.name}"


@dataclass
class Left:
    """One resource still in the project after the destroy, as the report lists it."""

    kind: str
    name: str
    size: str
    usd_month: float | None  # None: not priced here
    terraform: str  # who knows it: "state", "abandoned", "nobody"
    promised: bool  # docs/deploy.md says a destroy keeps it

    @property
    def label(self) -> str:
        return LABELS.get(self.kind, self.kind)


@dataclass
class _Managed:
    """A managed instance of a group: its name and the stateful disks kept for it."""

    name: str
    zone: str
    up: bool = False
    kept: dict[str, str] = field(default_factory=dict)  # device name -> disk key


class FakeProject:
    """One project; a context manager (it owns the Cloud Storage emulator of the stack's bucket)."""

    def __init__(self, project: str, *, log: Path | None = None,
                 billing_accounts: dict[str, str] | None = None) -> None:
        self.project = project
        self.log = log
        #: Billing accounts the deployer holds billing.budgets.create on -> each one's currency.
        #: None by default: a project's Owner alone holds nothing on a billing account.
        self.billing_accounts: dict[str, str] = dict(billing_accounts or {})
        self.things: dict[str, Thing] = {}
        #: What Terraform's state knows: address -> attributes (references resolved)
        self.state: dict[str, dict[str, Any]] = {}
        self.gcs: StorageEmulator | None = None
        self.bucket: str | None = None
        self.managed: dict[str, dict[str, _Managed]] = {}  # group name -> instance name -> state
        self.soft_deleted_bytes = 0
        self.destroyed: Destroyed | None = None
        self._disk_seq = 0
        #: The apply's clock, in seconds: when each address was created (`_created`).
        self.clock = 0.0
        self.created: dict[str, float] = {}

    def __enter__(self) -> "FakeProject":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.gcs is not None:
            self.gcs.stop()

    # --- apply ---------------------------------------------------------------------------------
    def apply(self, stack: dict[str, Any], files: dict[str, Path]) -> None:
        """Create everything `stack` declares. `files`: object name -> the local file a
        `google_storage_bucket_object` uploads (the drill's packed archives); every object the
        stack declares must have one, and every file must be an object the stack declares."""
        resources: dict[str, dict[str, Any]] = stack.get("resource", {})
        buckets = list(resources.get("google_storage_bucket", {}).values())
        if len(buckets) != 1:
            raise ProjectError(f"the stack declares {len(buckets)} buckets; the fake project holds one")
        resolved = {k: {key: self._resolve(resources, attrs) for key, attrs in items.items()}
                    for k, items in resources.items()}
        for key, budget in resolved.get("google_billing_budget", {}).items():
            self._check_budget(f"google_billing_budget.{key}", budget, resolved)
        created = self._created(resources)
        self._check_alert_policies(resources, resolved, created)
        self.created.update(created)
        self.clock = max([self.clock, *created.values()])
        self.bucket = resolved["google_storage_bucket"][next(iter(resources["google_storage_bucket"]))]["name"]
        self.gcs = StorageEmulator(self.bucket, log=self.log).start()
        declared = {a["name"] for a in resolved.get("google_storage_bucket_object", {}).values()}
        extra = sorted(set(files) - declared)
        if extra:
            raise ProjectError(f"the drill ships {', '.join(extra)}, which the stack does not declare "
                               f"(it declares {', '.join(sorted(declared)) or 'no objects'})")
        for k, items in resolved.items():
            for key, attrs in items.items():
                address = f"{k}.{key}"
                self.state[address] = read_back(k, attrs)  # the refresh after the create
                if k == "google_storage_bucket_object":
                    if attrs["name"] not in files:
                        raise ProjectError(f"{address}: no file for object {attrs['name']} (the drill packs "
                                           f"{', '.join(sorted(files)) or 'nothing'})")
                    self._bucket().blob(attrs["name"]).upload_from_filename(
                        str(files[attrs["name"]]), content_type=attrs.get("content_type"))
                    continue  # it lives in the bucket
                name = str(attrs.get("name") or attrs.get("secret_id") or attrs.get("account_id")
                           or attrs.get("role_id") or attrs.get("service") or key)
                where = str(attrs.get("zone") or attrs.get("region") or attrs.get("location") or "global")
                thing = Thing(k, name, attrs, address, where)
                self.things[thing.key] = thing
                if k in GROUP_KINDS:
                    self.managed[name] = {}

    def _check_budget(self, address: str, budget: dict[str, Any], resolved: dict[str, Any]) -> None:
        """What the Budget API refuses (cloud.google.com/billing/docs/reference/budget/rest/v1/
        billingAccounts.budgets): a caller without billing.budgets.create on the billing account (a
        permission of the account, never of a project: cloud.google.com/billing/docs/how-to/
        budgets#budget-permissions); a notification channel that is not an email channel
        (NotificationsRule.monitoringNotificationChannels: "only email channels are supported");
        a currencyCode other than the billing account's ("must match the currency of the billing
        account")."""
        account = budget.get("billing_account")
        if account not in self.billing_accounts:
            raise ProjectError(f"{address}: 403 PERMISSION_DENIED: the caller does not have permission "
                               f"billing.budgets.create on billingAccounts/{account}")
        channels = resolved.get("google_monitoring_notification_channel", {})
        for ref in (budget.get("all_updates_rule") or {}).get("monitoring_notification_channels", []):
            m = re.fullmatch(r"\$\{google_monitoring_notification_channel\.([^.]+)\.name\}", str(ref))
            kind = channels.get(m.group(1), {}).get("type") if m else None
            if kind != "email":
                raise ProjectError(f"{address}: 400 INVALID_ARGUMENT: notification channel {ref} is "
                                   f"{kind or 'unknown'}; budgets take email channels only")
        currency = ((budget.get("amount") or {}).get("specified_amount") or {}).get("currency_code")
        if currency is not None and currency != self.billing_accounts[account]:
            raise ProjectError(f"{address}: 400 INVALID_ARGUMENT: currency_code {currency} does not match the "
                               f"billing account's currency {self.billing_accounts[account]}")

    def _created(self, resources: dict[str, dict[str, Any]]) -> dict[str, float]:
        """When the apply creates each new address on the project's clock: as soon as everything
        it depends on is done (Terraform creates in dependency order, the rest in parallel). A
        resource whose local-exec provisioner is `sleep N` exists at once but is done N seconds
        later: what depends on it starts then (a provisioner runs once, when its resource is
        created; developer.hashicorp.com/terraform/language/resources/provisioners/syntax). What
        the state already holds was created before."""
        done: dict[str, float] = {}
        exists: dict[str, float] = {}

        def at(address: str, seen: tuple[str, ...] = ()) -> float:
            if address in done:
                return done[address]
            if address in self.created and address in self.state:
                return self.created[address]
            k, _, key = address.partition(".")
            attrs = resources.get(k, {}).get(key)
            if attrs is None or address in seen:
                return self.clock
            start = max([self.clock, *(at(d, (*seen, address)) for d in self._deps(attrs))])
            took = 0.0
            for prov in attrs.get("provisioner") or []:
                m = _SLEEP.fullmatch(str((prov.get("local-exec") or {}).get("command", "")).strip())
                if m and (prov.get("local-exec") or {}).get("when") in (None, "create"):
                    took += float(m.group(1))
            exists[address], done[address] = start, start + took
            return done[address]

        for k, items in resources.items():
            for key in items:
                at(f"{k}.{key}")
        return {a: t for a, t in exists.items() if a not in self.state}

    def _check_alert_policies(self, resources: dict[str, dict[str, Any]], resolved: dict[str, Any],
                              created: dict[str, float]) -> None:
        """What `projects.alertPolicies.create` refuses (cloud.google.com/monitoring/api/ref_v3/rest/
        v3/projects.alertPolicies/create): a condition naming a log-based metric Monitoring does
        not know yet, 404 "Cannot find metric(s) that match type = ..." for up to 10 minutes
        after the metric's creation; the provider retries only 409, so the apply fails there
        (hashicorp/terraform-provider-google#11102, still so with 7.x). A metric the stack does
        not declare and the project does not hold is never known."""
        metrics = {str(attrs.get("name")): f"google_logging_metric.{key}"
                   for key, attrs in resolved.get("google_logging_metric", {}).items()}
        for key, policy in resolved.get("google_monitoring_alert_policy", {}).items():
            address = f"google_monitoring_alert_policy.{key}"
            if address not in created:
                continue  # it exists already: the apply does not create it again
            start = created[address]
            named: list[str] = []
            for c in policy.get("conditions") or []:
                for part in ("condition_threshold", "condition_absent"):
                    named += _USER_METRIC.findall(str((c.get(part) or {}).get("filter", "")))
                query = str((c.get("condition_prometheus_query_language") or {}).get("query", ""))
                named += [m.replace("_", "/") for m in _PROMQL_USER_METRIC.findall(query)]
            for name in named:
                metric = metrics.get(name) or next((m for n, m in metrics.items()
                                                    if n.replace("_", "/") == name), None)
                born = None if metric is None else created.get(metric, self.created.get(metric))
                if born is None or start - born < METRIC_VISIBLE_S:
                    raise ProjectError(
                        f"{address}: Error creating AlertPolicy: googleapi: Error 404: Cannot find metric(s) that "
                        f'match type = "logging.googleapis.com/user/{name}". If a metric was created recently, it '
                        "could take up to 10 minutes to become available. Please try again soon.")

    @staticmethod
    def _deps(attrs: dict[str, Any]) -> set[str]:
        refs = {f"{m.group(1)}.{m.group(2)}" for m in _REF.finditer(json.dumps(attrs))}
        return refs | set(attrs.get("depends_on") or [])

    def plan(self, stack: dict[str, Any]) -> list[str]:
        """The addresses a plan of `stack` against this project's state would create or change."""
        resources: dict[str, dict[str, Any]] = stack.get("resource", {})
        changed = []
        for k, items in resources.items():
            for key, attrs in items.items():
                address = f"{k}.{key}"
                want, have = self._resolve(resources, attrs), self.state.get(address)
                if have is None:
                    changed.append(address)
                    continue
                for field_, value in want.items():
                    old = have.get(field_)
                    same = (_dashboard_same(old, value) if k == "google_monitoring_dashboard" and
                            field_ == "dashboard_json" and isinstance(old, str) else old == value)
                    if not same:
                        changed.append(address)
                        break
        return sorted(changed)

    def _resolve(self, resources: dict[str, dict[str, Any]], attrs: dict[str, Any]) -> dict[str, Any]:
        """`${TYPE.ID.ATTR}` -> what apply fills in, where it is an attribute of the stack itself
        (names, emails); what only the API knows (ids, self links) stays a reference."""
        from drill.iam import PolicyError, _Resolver

        ref = _Resolver(resources)

        def one(m: re.Match[str]) -> str:
            try:
                return ref.value(m.group(1), m.group(2), m.group(3))
            except PolicyError:
                return m.group(0)

        return json.loads(_REF.sub(lambda m: one(m).replace("\\", "\\\\").replace('"', '\\"'), json.dumps(attrs)))

    def _bucket(self) -> Any:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        assert self.gcs is not None and self.bucket is not None, "apply a stack first"
        client = storage.Client(project=self.project, credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": self.gcs.host})
        return client.bucket(self.bucket)

    def objects(self) -> dict[str, int]:
        """The bucket's objects: name -> bytes (the real client's listing); none once deleted."""
        if self.gcs is None:
            return {}
        return {b.name: int(b.size or 0) for b in self._bucket().client.list_blobs(self.bucket)}

    # --- the groups' VMs ---------------------------------------------------------------------------
    def _group(self, name: str) -> Thing:
        for t in self.things.values():
            if t.kind in GROUP_KINDS and t.name == name:
                return t
        raise ProjectError(f"no group {name} in the project")

    def _template(self, group: Thing) -> Thing:
        link = str(group.attrs["version"][0]["instance_template"])
        m = _REF.fullmatch(link)
        if m is None or m.group(1) not in TEMPLATE_KINDS:
            raise ProjectError(f"{group.address}: its template {link!r} is not a template of the stack")
        found = [t for t in self.things.values() if t.address == f"{m.group(1)}.{m.group(2)}"]
        if not found:
            raise ProjectError(f"{group.address}: its template {m.group(1)}.{m.group(2)} does not exist")
        return found[0]

    def _stateful(self, group: Thing) -> dict[str, str]:
        """device name -> delete rule of the group's stateful disks."""
        return {d["device_name"]: d.get("delete_rule", "NEVER") for d in group.attrs.get("stateful_disk") or []}

    def instance_up(self, group_name: str, instance: str) -> None:
        """The group created (or recreated) `instance`: a VM with its template's disks; a stateful
        disk kept for this managed instance is reattached instead of created."""
        group = self._group(group_name)
        template = self._template(group)
        zone = str(group.attrs.get("zone") or (group.attrs.get("distribution_policy_zones") or [f"{group.location}-a"])[0])
        mi = self.managed[group_name].setdefault(instance, _Managed(instance, zone))
        mi.up = True
        self.things[f"instance/{zone}/{instance}"] = Thing("instance", instance, {"group": group_name}, None, zone)
        for i, disk in enumerate(template.attrs.get("disk") or []):
            device = disk.get("device_name") or ("boot" if disk.get("boot") else f"persistent-disk-{i}")
            if device in mi.kept:
                self.things[mi.kept[device]].attached_to = instance
                continue
            if disk.get("type") == "SCRATCH" or disk.get("disk_type") == "local-ssd":
                continue  # local SSDs live and die with the VM
            self._disk_seq += 1
            d = Thing("disk", f"{instance}-{device}-{self._disk_seq}", {"device_name": device, **disk}, None, zone,
                      float(disk.get("disk_size_gb") or 10), str(disk.get("disk_type") or "pd-standard"), instance)
            self.things[d.key] = d
            if device in self._stateful(group):
                mi.kept[device] = d.key

    def instance_down(self, group_name: str, instance: str, target_size: int) -> None:
        """The VM `instance` was deleted (preempted with termination action DELETE, or powered off);
        the group recreates it unless its target is below its managed instances (`resize`)."""
        mi = self.managed[self._group(group_name).name].get(instance)
        if mi is None or not mi.up:
            raise ProjectError(f"{instance} of {group_name} is not running")
        self._vm_gone(mi)
        self.resize(group_name, target_size)

    def _vm_gone(self, mi: _Managed) -> None:
        """A VM is deleted: its disks go with it unless they are its stateful ones (kept for the
        managed instance) or `auto_delete = false` (left behind)."""
        mi.up = False
        self.things.pop(f"instance/{mi.zone}/{mi.name}", None)
        kept = set(mi.kept.values())
        for key, d in list(self.things.items()):
            if d.kind == "disk" and d.attached_to == mi.name:
                d.attached_to = None
                if key not in kept and d.attrs.get("auto_delete", True):
                    del self.things[key]

    def resize(self, group_name: str, target_size: int) -> None:
        """The group's target moved: managed instances beyond it are deleted for good, and their
        stateful disks with them where the delete rule says so."""
        rules = self._stateful(self._group(group_name))
        members = self.managed[group_name]
        for name in list(members)[max(0, target_size):]:
            mi = members.pop(name)
            if mi.up:
                self._vm_gone(mi)
            for device, key in mi.kept.items():
                if rules.get(device) == "ON_PERMANENT_INSTANCE_DELETION":
                    self.things.pop(key, None)

    def sync(self, compute: Any) -> None:
        """Take over what the fake Google APIs hold after the drill: each group's target size,
        each secret's versions."""
        for name in list(self.managed):
            if name in getattr(compute, "groups", {}):
                self.resize(name, compute.group(name).target_size)
        for t in self.things.values():
            if t.kind == "google_secret_manager_secret":
                full = f"projects/{t.attrs.get('project', self.project)}/secrets/{t.name}"
                if full in compute.secrets:
                    t.attrs["_versions"] = [v["state"] for v in compute.secret_versions(full)]

    # --- destroy -------------------------------------------------------------------------------
    def destroy(self) -> Destroyed:
        """`terraform destroy` of the applied stack (drill.provider's model), in the project."""
        held = self.objects()
        objects = {self.bucket: sorted(held)} if held else {}
        out = destroy(self.state, objects)
        by_address = {t.address: key for key, t in self.things.items() if t.address}
        for address in out.deleted:
            key = by_address.get(address)
            if key is None:
                continue
            thing = self.things[key]
            if thing.kind in GROUP_KINDS:  # its managed instances go for good first
                self.resize(thing.name, 0)
                del self.managed[thing.name]
            del self.things[key]
        for address in out.forgotten:
            key = by_address.get(address)
            if key:
                self.things[key].attrs["_abandoned"] = True
                self.things[key].address = None
        for bucket, names in out.objects_deleted.items():
            b = self._bucket()
            for name in names:
                self.soft_deleted_bytes += held.get(name, 0)
                if bucket == self.bucket:
                    b.blob(name).delete()
        if not any(t.kind == "google_storage_bucket" for t in self.things.values()) and self.gcs is not None:
            self.gcs.stop()  # the bucket was deleted, with everything in it
            self.gcs = None
        self.destroyed = out
        return out

    # --- what is left --------------------------------------------------------------------------
    def left(self, promised: tuple[str, ...] = ("google_storage_bucket", "google_secret_manager_secret")
             ) -> tuple[list[Left], list[str]]:
        """(what still exists and bills or could, the APIs left enabled). `promised`: the kinds
        docs/deploy.md says a destroy keeps."""
        from stacks import pricing

        out: list[Left] = []
        apis: list[str] = []
        for t in sorted(self.things.values(), key=lambda t: (t.kind, t.name)):
            who = "state" if t.address else "abandoned" if t.attrs.get("_abandoned") else "nobody"
            if t.kind == "google_project_service":
                apis.append(t.name)
                continue
            if t.kind == "google_storage_bucket":
                objects = self.objects()
                size = sum(objects.values())
                location = str(t.attrs.get("location", "")).upper()
                rate = pricing.GCS_STANDARD_GB_MONTH["multi-region" if location in pricing.GCS_MULTI_REGIONS
                                                     else "region"]
                prefixes = sorted({"/".join(n.split("/")[:2]) + "/" for n in objects})
                text = (f"{_bytes(size)} in {len(objects)} object(s) ({', '.join(prefixes) or 'empty'}), "
                        f"{location}; STANDARD ${rate:.3f}/GB-month")
                if self.soft_deleted_bytes:
                    days = int(t.attrs.get("soft_delete_policy", {}).get("retention_duration_seconds", 0)) // 86400
                    text += f"; {_bytes(self.soft_deleted_bytes)} soft-deleted by the destroy, billed {days} d"
                out.append(Left(t.kind, t.name, text, size / 1e9 * rate, who, t.kind in promised))
            elif t.kind == "google_secret_manager_secret":
                active = [s for s in t.attrs.get("_versions", []) if s in ("ENABLED", "DISABLED")]
                replicas = t.attrs.get("replication", {}).get("user_managed", {}).get("replicas") or [{}]
                cost = len(active) * len(replicas) * pricing.SECRET_VERSION_USD_MONTH
                out.append(Left(t.kind, t.name, f"{len(active)} active version(s) x {len(replicas)} location(s); "
                                f"${pricing.SECRET_VERSION_USD_MONTH:.2f}/version-month", cost, who,
                                t.kind in promised))
            elif t.kind == "disk":
                region = t.location.rsplit("-", 1)[0]
                _, prices, _ = pricing.region_prices(region)
                rate = prices.disk_gb_month.get(t.disk_type)
                cost = None if rate is None else (t.size_gb or 0) * rate.on_demand
                where = f"attached to {t.attached_to}" if t.attached_to else "detached"
                out.append(Left(t.kind, t.name, f"{t.size_gb:g} GB {t.disk_type} in {t.location}, {where}",
                                cost, who, False))
            else:
                out.append(Left(t.kind, t.name, t.location, None, who, False))
        return out, apis


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
