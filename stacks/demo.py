"""`python -m stacks.demo [FILE]`: synthesize one experiment and say what it would create.

Default FILE: experiments/example.toml. Prints the resources with their key settings, the
emergency-save budget, the expected cost (Spot against on demand) and the outputs; writes
nothing outside a temporary folder.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

from stacks.budget import estimate
from stacks.cost import describe as describe_cost
from stacks.errors import InputError, report
from stacks.load import display, load_file

EXAMPLE = Path("experiments/example.toml")


def _retention(bucket: dict) -> str:
    """What the synthesized bucket keeps of a deleted or overwritten object, read from its own
    versioning, lifecycle rules and soft delete policy (not from the experiment file)."""
    parts = []
    if (bucket.get("versioning") or {}).get("enabled"):
        limits = []
        for rule in bucket.get("lifecycle_rule") or []:
            condition = rule.get("condition") or {}
            if condition.get("num_newer_versions"):
                limits.append(f"{condition['num_newer_versions']} older versions")
            if condition.get("days_since_noncurrent_time"):
                limits.append(f"{condition['days_since_noncurrent_time']} d")
        parts.append("versioned" + (f" (at most {', '.join(limits)})" if limits else
                                    " (old versions kept forever)"))
    else:
        parts.append("not versioned")
    seconds = (bucket.get("soft_delete_policy") or {}).get("retention_duration_seconds") or 0
    parts.append(f"soft delete {seconds / 86400:g} d" if seconds else "soft delete off")
    return ", ".join(parts)


def _summary(kind: str, r: dict, stack: dict | None = None) -> str:
    stack = stack or {}
    if kind == "google_compute_instance_template":
        s = r["scheduling"]
        action = s.get("instance_termination_action")
        gpus = r.get("guest_accelerator") or []
        gpu = f", attached {gpus[0]['count']} x {gpus[0]['type']}" if gpus else ", GPUs built in"
        disks = ", ".join(f"{d.get('disk_type')} {d.get('disk_size_gb')} GB"
                          + (f" ({d['device_name']})" if d.get("device_name") else "")
                          for d in r["disk"])
        return (f"{r['name_prefix']}*  {r['machine_type']}{gpu}, {s['provisioning_model']}"
                f"{' -> ' + action if action else ''}"
                f", disks: {disks}, no external IP, shielded")
    if kind.endswith("instance_group_manager"):
        where = r.get("zone") or ",".join(r.get("distribution_policy_zones", []))
        size = r["target_size"]
        if isinstance(size, str):  # stacks.scale_to_zero: 0 once a stop marker exists
            size = f"{size.rsplit(':', 1)[-1].strip(' }')} (0 once the job has stopped itself)"
        heal = r.get("auto_healing_policies")
        disk = r.get("stateful_disk")
        return (f"{r['name']}  size {size} in {where}, "
                + (f"autoheal after {heal['initial_delay_sec']} s, " if heal else "no autohealing, ")
                + (f"stateful disk {disk[0]['device_name']}, " if disk else "no stateful disk, ")
                + f"update {r['update_policy']['type']}"
                + (f"/{r['update_policy']['replacement_method']}" if "replacement_method" in r["update_policy"] else ""))
    if kind == "google_storage_bucket":
        return (f"{r['name']}  {r['location']}, {_retention(r)}, public access "
                f"{r['public_access_prevention']}, force_destroy={str(r['force_destroy']).lower()}")
    if kind == "google_compute_firewall":
        ports = ",".join(p for a in r["allow"] for p in a.get("ports", [])) or "all ports"
        if "source_service_accounts" in r:  # a pool's rule: between its own nodes only
            return f"{r['name']}  tcp:{ports} from and to the trainer service account only"
        return f"{r['name']}  tcp:{ports} from {', '.join(r['source_ranges'])}"
    if kind == "google_compute_instance":
        s = r["scheduling"]
        status = r["desired_status"]
        if "${" in status:  # stacks.scale_to_zero: stopped once a stop marker exists
            status = "RUNNING (TERMINATED once the job has stopped itself)"
        return (f"{r['name']}  {r['machine_type']}, {s['provisioning_model']}, role "
                f"{r['metadata'].get('spottrain-role')}, {status}, static internal "
                "IP, no external IP, shielded")
    if kind == "google_dns_record_set":
        return f"{r['name']}  {r['type']} -> the coordinator's static IP"
    if kind == "google_dns_managed_zone":
        return f"{r['name']}  {r['dns_name']} ({r['visibility']}, the experiment's network)"
    if kind == "google_compute_address":
        return f"{r['name']}  {r['address_type']} in {r['region']}"
    if kind == "google_compute_disk":
        return f"{r['name']}  {r['type']} {r['size']} GB in {r['zone']}"
    if kind == "google_compute_health_check":
        t = r["tcp_health_check"]
        return (f"{r['name']}  tcp:{t['port']} sends {t['request']!r}, expects {t['response']!r}, "
                f"every {r['check_interval_sec']} s")
    if kind.endswith("iam_member"):
        role = r["role"] if not r["role"].startswith("${") else f"custom role {_name_of(stack, r['role'])}"
        if "bucket" in r:
            where = " on the checkpoint bucket"
        elif "secret_id" in r:
            where = f" on the secret {_name_of(stack, r['secret_id'])}"
        elif "name" in r or "instance_name" in r:
            target = kind.removeprefix("google_").removesuffix("_iam_member")
            target = "Cloud Run job" if target == "cloud_run_v2_job" else target.replace("_", " ")
            where = f" on the {target} {_name_of(stack, r.get('name') or r['instance_name'])}"
        else:
            where = " on the project"
        member = r.get("member", "")
        who = f" for {_name_of(stack, member.split(':', 1)[-1])}" if member else ""
        return role + where + who + (f" if {r['condition']['title']}" if "condition" in r else "")
    if kind == "google_monitoring_dashboard":
        return str(json.loads(r.get("dashboard_json") or "{}").get("displayName") or "")
    if kind == "google_service_account":
        return f"{r['account_id']}  {r.get('display_name') or ''}".rstrip()
    if kind == "google_project_iam_custom_role":
        return f"{r['role_id']}  {r['title']}"
    return _name(r)


#: The attributes that name a resource, most telling first (a row never goes out blank).
_NAMING = ("name", "display_name", "account_id", "secret_id", "service", "role_id", "title")
_REF = re.compile(r"^\$\{(google_[a-z0-9_]+)\.([^.}]+)\.[a-z_]+\}$")


def _name(r: dict) -> str:
    """Its name, else where the stack's code made it (the construct path: e.g. a `terraform_data`)."""
    named = next((str(r[k]) for k in _NAMING if isinstance(r.get(k), str) and r[k]), "")
    return named or str(((r.get("//") or {}).get("metadata") or {}).get("path") or "")


def _name_of(stack: dict, value: str) -> str:
    """A Terraform reference (`${google_service_account.X.email}`) as the name of what it refers
    to in the stack (its account id, secret id, role id, ...); any other value as it is."""
    m = _REF.match(value)
    if not m:
        return value
    target = stack.get("resource", {}).get(m.group(1), {}).get(m.group(2))
    if target is None:
        return value
    return str(target.get("role_id") or target.get("account_id") or _name(target) or value)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else EXAMPLE
    from stacks.app import build

    try:
        exp = load_file(path)
        with tempfile.TemporaryDirectory(prefix="spottrain-demo-") as out:
            build([exp], outdir=out).synth()
            stack = json.loads((Path(out) / "stacks" / exp.name / "cdk.tf.json").read_text())
    except InputError as err:  # a bad file, unlocked or unfetchable wheels, unpackable code
        return report(err)
    print(f"{display(path)} -> stack {exp.name!r} in project {exp.spec.gcp.project}, "
          f"region {exp.spec.gcp.region}")
    print()
    for kind, resources in sorted(stack["resource"].items()):
        for r in resources.values():
            print(f"  {kind.removeprefix('google_'):34} {_summary(kind, r, stack)}")
    print()
    budget = estimate(exp.spec)
    print(budget.warning() or budget.describe())
    print()
    print("\n".join(describe_cost(exp)))
    print()
    backend = next(iter(stack["terraform"]["backend"].items()))
    print(f"state backend: {backend[0]} {json.dumps(backend[1])}")
    print("outputs after deploy:")
    for key, out_ in stack["output"].items():
        value = out_["value"]
        print(f"  {key:24} {value if '${' not in value else '(known after deploy)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
