"""checkov over synthesized stacks, with the project's only list of skipped checks.

JSON cannot carry `checkov:skip` comments, so every skip lives here with its reason and is passed
as --skip-check; tests assert nothing else skips a check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SKIPS: dict[str, str] = {
    "CKV_GCP_62": "Bucket access logs need a second log bucket per experiment; Cloud Audit Logs "
    "(data access) are the supported way to audit checkpoint reads and writes.",
    "CKV_GCP_37": "A pool coordinator's checkpoint disk uses Google-managed encryption, like every "
    "disk the workers' template creates (which checkov does not inspect); CSEK would put a raw key "
    "into the Terraform state and be needed at every restart.",
    "CKV_GCP_38": "A pool coordinator's boot disk uses Google-managed encryption, like the "
    "workers' boot disks from the template; CSEK would put a raw key into the Terraform state and "
    "be needed at every restart.",
    "CKV_GCP_78": "Versioning is off by default: every object the trainer writes is create-only "
    "under a new name, so versions would keep only deleted (rotated) checkpoints, which soft "
    "delete (7 days by default) keeps already; both together bill each rotated checkpoint twice "
    "as long. Cloud Storage recommends soft delete instead of versioning; bucket.versioning = "
    "true turns it on.",
    "CKV_GCP_76": "The subnet is IPv4-only; private_ip_google_access = true gives its VMs Google "
    "APIs without external IPs, and there is no IPv6 traffic to route privately.",
}


def checkov_bin() -> str:
    return str(Path(sys.prefix) / "bin" / "checkov")


def run(files: list[Path], skips: dict[str, str] = SKIPS) -> dict:
    """Run checkov once over every file: counts of passed, skipped and parsing errors, and the
    failed checks as (check, resource, file)."""
    cmd = [checkov_bin(), "--framework", "terraform_json", "--output", "json", "--quiet",
           "--skip-download"]
    if skips:
        cmd += ["--skip-check", ",".join(sorted(skips))]
    for f in files:
        cmd += ["-f", str(f)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"checkov failed ({proc.returncode}): {proc.stderr[-2000:]}")
    reports = json.loads(proc.stdout) if proc.stdout.strip() else []
    if isinstance(reports, dict):
        reports = [reports]
    out: dict = {"passed": 0, "skipped": 0, "parsing_errors": 0, "failed": []}
    for rep in reports:
        for key in ("passed", "skipped", "parsing_errors"):
            out[key] += rep.get("summary", {}).get(key, 0)
        out["failed"] += [(c["check_id"], c["resource"], c["file_path"])
                          for c in rep.get("results", {}).get("failed_checks", [])]
    return out
