"""`python -m stacks.preflight [FILE|DIR]` (`make preflight EXPERIMENT=...`): what the APIs would
refuse, or what would starve the job, checked before a deploy with your own credentials.

Read-only REST calls with application-default credentials (`gcloud auth application-default
login`), one line per check:

- **APIs** enabled in the project (Service Usage `services:batchGet`): Compute, IAM, Storage,
  plus Cloud DNS for a pool and Cloud Run + Cloud Scheduler for the control job (`stacks.control`:
  every experiment that stops paying by itself, asks for flex-start successors or falls back);
- **GPU quota** in the region for the provisioning model (`regions.get` quotas:
  `PREEMPTIBLE_NVIDIA_<GPU>_GPUS` for Spot and flex-start, `NVIDIA_<GPU>_GPUS` on demand), against
  what the experiment asks for at most;
- **machine type** offered in each zone (`machineTypes.get`), the ranked alternatives too;
- **image family** resolvable (`images.getFromFamily`);
- **Spot obtainability** per zone from the Compute API's capacity advice (`advice.capacity`):
  a score below 0.4 is a warning (likely a stockout now), not a failure;
- **your permissions**: the experiment's stack is synthesized and every permission its resource
  types need (`stacks.permissions`) is tested with `testIamPermissions` on the project (Resource
  Manager) and, for a `[budget]`, on the billing account (Cloud Billing), whose permissions no
  project role grants. A missing one fails, naming it, its resource types and a role that has it.

Exit status: 0 all checks passed (warnings allowed), 1 a check failed, 2 a bad experiment file,
3 no credentials (it then says what it would check). Endpoints: `SPOTTRAIN_COMPUTE_API` and
`SPOTTRAIN_SERVICEUSAGE_API`, `SPOTTRAIN_CRM_API` and `SPOTTRAIN_BILLING_API` point the calls at
the loopback fakes in the tests.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from stacks import gcp_rules as R
from stacks.boot import needs_control
from stacks.experiment import Experiment
from stacks.load import ExperimentError, ExperimentFile, argument, display, load_all
from trainer.cloud.gce import ApiError, Client

SERVICEUSAGE = "https://serviceusage.googleapis.com/v1"
CRM = "https://cloudresourcemanager.googleapis.com/v1"
BILLING = "https://cloudbilling.googleapis.com/v1"
#: Permissions per testIamPermissions request (Resource Manager and Cloud Billing take at most 100).
TEST_BATCH = 100
BASE_APIS = ("compute.googleapis.com", "iam.googleapis.com", "storage.googleapis.com")
#: The control job (`stacks.control`): Cloud Run runs it, Cloud Scheduler starts it.
CONTROL_APIS = ("run.googleapis.com", "cloudscheduler.googleapis.com")
#: Quota metric stem of each GPU type (regions.get quotas).
GPU_QUOTA = {
    R.L4: "NVIDIA_L4_GPUS", R.T4: "NVIDIA_T4_GPUS", R.V100: "NVIDIA_V100_GPUS", R.P100: "NVIDIA_P100_GPUS",
    R.P4: "NVIDIA_P4_GPUS", R.A100_40: "NVIDIA_A100_GPUS", R.A100_80: "NVIDIA_A100_80GB_GPUS",
    R.H100: "NVIDIA_H100_GPUS", R.H100_MEGA: "NVIDIA_H100_MEGA_GPUS",
}
#: Obtainability below this is called out (the capacity advice's "low chance" band is 0.0-0.3).
LOW_OBTAINABILITY = 0.4
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NO_CREDENTIALS = 0, 1, 2, 3


@dataclass(frozen=True)
class Result:
    level: str  # "ok" | "warn" | "FAIL"
    check: str
    detail: str

    def line(self) -> str:
        return f"  {self.level:4} {self.check}: {self.detail}"


def required_apis(exp: Experiment) -> tuple[str, ...]:
    """The APIs preflight checks with the caller's credentials. The stack enables what its
    resources need itself (`stacks.apis`, from the synthesized resources); a test keeps this list
    within that one."""
    apis = list(BASE_APIS)
    if exp.pool is not None:
        apis.append("dns.googleapis.com")
    if needs_control(exp):
        apis += CONTROL_APIS
    return tuple(apis)


def quota_metric(exp: Experiment) -> str:
    """Spot and flex-start draw on the preemptible quota; standard on the regular one."""
    stem = GPU_QUOTA[exp.machine.gpu_type]
    return stem if exp.machine.provisioning == "standard" else f"PREEMPTIBLE_{stem}"


def gpus_needed(exp: Experiment) -> tuple[int, int]:
    """(GPUs under `quota_metric`, on-demand GPUs of a pool's training coordinator) at most."""
    m = exp.machine
    if exp.pool is not None:
        from stacks.pool import layout

        pool = layout("x", exp)
        assert pool is not None
        return m.gpu_count * pool.max_workers, m.gpu_count if pool.coordinator_trains else 0
    return m.gpu_count * max(1, exp.group.workers), 0


def what_it_checks(exp: Experiment) -> list[str]:
    m = exp.machine
    lines = [f"APIs enabled in {exp.gcp.project}: {', '.join(required_apis(exp))}",
             f"GPU quota {quota_metric(exp)} in {exp.gcp.region}: {gpus_needed(exp)[0]} needed",
             f"machine type {', '.join([m.machine_type, *exp.capacity.machine_types])} offered in "
             + ", ".join(exp.gcp.zones),
             f"image family {m.image_project}/{m.image_family} resolvable"]
    if m.provisioning == "spot":
        lines.append(f"Spot obtainability of {m.machine_type} per zone (capacity advice)")
    lines.append("your permissions for every resource type of the stack (docs/reference/permissions.md)"
                 + (f", and on billing account {exp.budget.billing_account}" if exp.budget else ""))
    return lines


class Preflight:
    def __init__(self, exp: Experiment, client: Client, name: str = "") -> None:
        self.exp, self.c, self.name = exp, client, name
        self.serviceusage = (os.environ.get("SPOTTRAIN_SERVICEUSAGE_API") or SERVICEUSAGE).rstrip("/")
        self.crm = (os.environ.get("SPOTTRAIN_CRM_API") or CRM).rstrip("/")
        self.billing = (os.environ.get("SPOTTRAIN_BILLING_API") or BILLING).rstrip("/")

    def run(self) -> Iterator[Result]:
        for check in (self.apis, self.quota, self.machine_types, self.image, self.obtainability, self.permissions):
            try:
                yield from check()
            except ApiError as e:
                yield Result("FAIL", check.__name__, f"the API answered {e.code} {e.status}: {e.message}")

    def apis(self) -> Iterator[Result]:
        p = self.exp.gcp.project
        names = [f"projects/{p}/services/{a}" for a in required_apis(self.exp)]
        answer = self.c.request("GET", f"{self.serviceusage}/projects/{p}/services:batchGet",
                                query={"names": names}) or {}
        state = {s["name"].rsplit("/", 1)[-1]: s.get("state") for s in answer.get("services", [])}
        off = [a for a in required_apis(self.exp) if state.get(a) != "ENABLED"]
        if off:
            yield Result("FAIL", "apis", "not enabled: " + ", ".join(off)
                         + f" (gcloud services enable {' '.join(off)} --project {p})")
        else:
            yield Result("ok", "apis", "enabled: " + ", ".join(required_apis(self.exp)))

    def quota(self) -> Iterator[Result]:
        g = self.exp.gcp
        region = self.c.compute_call("GET", f"projects/{g.project}/regions/{g.region}")
        quotas = {q["metric"]: q for q in region.get("quotas", [])}
        need, coordinator = gpus_needed(self.exp)
        for metric, n in ((quota_metric(self.exp), need), (GPU_QUOTA[self.exp.machine.gpu_type], coordinator)):
            if n == 0:
                continue
            q = quotas.get(metric)
            free = (float(q["limit"]) - float(q.get("usage", 0))) if q else 0.0
            detail = f"{metric} in {g.region}: {free:g} free of {float(q['limit']) if q else 0:g}, {n} needed"
            yield Result("ok" if free >= n else "FAIL", "quota",
                         detail + ("" if free >= n else " (request more: IAM & Admin > Quotas)"))

    def machine_types(self) -> Iterator[Result]:
        g, m = self.exp.gcp, self.exp.machine
        for t in [m.machine_type, *self.exp.capacity.machine_types]:
            missing = [z for z in g.zones if self.c.compute_call(
                "GET", f"projects/{g.project}/zones/{z}/machineTypes/{t}", ok404=True) is None]
            if missing:
                yield Result("FAIL", "machine type", f"{t} is not offered in {', '.join(missing)}")
            else:
                yield Result("ok", "machine type", f"{t} offered in {', '.join(g.zones)}")

    def image(self) -> Iterator[Result]:
        m = self.exp.machine
        image = self.c.compute_call("GET", f"projects/{m.image_project}/global/images/family/{m.image_family}",
                                    ok404=True)
        if image is None:
            yield Result("FAIL", "image", f"family {m.image_project}/{m.image_family} resolves to no image "
                         "(older Deep Learning VM families have been removed)")
        else:
            yield Result("ok", "image", f"{m.image_project}/{m.image_family} -> {image.get('name')}")

    def _granted(self, url: str, wanted: list[str]) -> set[str]:
        granted: set[str] = set()
        for i in range(0, len(wanted), TEST_BATCH):
            answer = self.c.request("POST", url, body={"permissions": wanted[i:i + TEST_BATCH]}) or {}
            granted |= set(answer.get("permissions", []))
        return granted

    def permissions(self) -> Iterator[Result]:
        from stacks import permissions as P

        if not self.name:
            return
        from stacks.stack import synthesized

        need = P.needed(synthesized(self.name, self.exp))
        p = self.exp.gcp.project
        checks = [(P.PROJECT, f"project {p}", f"{self.crm}/projects/{p}:testIamPermissions")]
        if need.billing_account is not None:
            checks.append((P.BILLING_ACCOUNT, f"billing account {need.billing_account}",
                           f"{self.billing}/billingAccounts/{need.billing_account}:testIamPermissions"))
        for scope, where, url in checks:
            wanted = need.permissions(scope)
            granted = self._granted(url, wanted)
            missing = [x for x in wanted if x not in granted]
            if not missing:
                yield Result("ok", "permissions", f"all {len(wanted)} the stack needs on {where}")
                continue
            kinds = need.by_scope[scope]
            roles = sorted({P.NEEDS[k].role if k in P.NEEDS and x in P.NEEDS[k].permissions else P.BUDGET_QUOTA.role
                            for x in missing for k in kinds[x]})
            yield Result("FAIL", "permissions", f"missing on {where}: " + ", ".join(
                f"{x} ({', '.join(sorted(kinds[x]))})" for x in missing) + f"; a role that grants them: {', '.join(roles)}")

    def obtainability(self) -> Iterator[Result]:
        g, m = self.exp.gcp, self.exp.machine
        if m.provisioning != "spot":
            return
        for zone in g.zones:
            body = {"instanceProperties": {"scheduling": {"provisioningModel": "SPOT"}},
                    "instanceFlexibilityPolicy": {"instanceSelections": {
                        "trainer": {"machineTypes": [m.machine_type]}}},
                    "distributionPolicy": {"targetShape": "ANY_SINGLE_ZONE", "zones": [{"zone": f"zones/{zone}"}]},
                    "size": max(1, self.exp.group.workers)}
            answer = self.c.compute_call("POST", f"projects/{g.project}/regions/{g.region}/advice/capacity",
                                         body=body)
            recs = answer.get("recommendations") or [{}]
            scores = recs[0].get("scores", {})
            score = float(scores.get("obtainability", 0.0))
            uptime = scores.get("estimatedUptime", "?")
            yield Result("ok" if score >= LOW_OBTAINABILITY else "warn", "spot obtainability",
                         f"{m.machine_type} in {zone}: {score:.2f} (estimated uptime {uptime})"
                         + ("" if score >= LOW_OBTAINABILITY else ": likely no Spot capacity right now"))


def adc_token() -> Callable[[], tuple[str, float]]:
    """A token source from application-default credentials (DefaultCredentialsError if none)."""
    import google.auth
    import google.auth.transport.requests

    creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    request = google.auth.transport.requests.Request()

    def token() -> tuple[str, float]:
        creds.refresh(request)
        valid = (creds.expiry.timestamp() - time.time()) if getattr(creds, "expiry", None) else 300.0
        return creds.token, max(valid, 60.0)

    return token


def preflight(e: ExperimentFile, client: Client) -> tuple[list[str], bool]:
    results = list(Preflight(e.spec, client, e.name).run())
    lines = [f"preflight of {e.name} ({display(e.path)}): project {e.spec.gcp.project}, {e.spec.gcp.region}"]
    lines += [r.line() for r in results]
    return lines, not any(r.level == "FAIL" for r in results)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m stacks.preflight [EXPERIMENT.toml | DIR | NAME]", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        experiments = load_all(argument(args[0]) if args else None)
    except ExperimentError as err:
        print("\n".join(err.lines), file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        token = adc_token()
        token()
    except Exception as err:  # google.auth raises several kinds; none is worth a traceback here
        print(f"preflight: no usable application-default credentials ({type(err).__name__}: "
              f"{str(err).splitlines()[0] if str(err) else 'none'}); run `gcloud auth application-default "
              "login`. With them it would check:", file=sys.stderr)
        for e in experiments:
            for line in what_it_checks(e.spec):
                print(f"  {e.name}: {line}", file=sys.stderr)
        return EXIT_NO_CREDENTIALS
    client = Client(token=token, retries=2)
    ok = True
    for i, e in enumerate(experiments):
        if i:
            print()
        lines, passed = preflight(e, client)
        print("\n".join(lines))
        ok = ok and passed
    return EXIT_OK if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
