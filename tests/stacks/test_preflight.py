"""`make preflight`: the REST checks with application-default credentials, against the fake
Google APIs (drill/fake_gcp.py), and what it says without credentials."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from drill.fake_gcp import FakeGcp
from drill.net import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "experiments" / "example.toml"
IMAGE = ("deeplearning-platform-release", "pytorch-2-9-cu129-ubuntu-2204-nvidia-580")


@pytest.fixture
def gcp(tmp_path: Path) -> Iterator[tuple[FakeGcp, dict[str, str]]]:
    with FakeGcp("my-project-123456") as fake:
        fake.add_region("us-central1", ("us-central1-a", "us-central1-b"),
                        {"PREEMPTIBLE_NVIDIA_L4_GPUS": 4, "NVIDIA_L4_GPUS": 1}, ("g2-standard-8",))
        fake.add_image(*IMAGE)
        fake.services.update({a: "ENABLED" for a in ("compute.googleapis.com", "iam.googleapis.com",
                                                      "storage.googleapis.com", "run.googleapis.com",
                                                      "cloudscheduler.googleapis.com")})
        adc = fake.key_file(tmp_path / "adc.json", "deployer@my-project-123456.iam.gserviceaccount.com")
        env = {**os.environ, "GOOGLE_APPLICATION_CREDENTIALS": str(adc), "SPOTTRAIN_COMPUTE_API": fake.compute_api,
               "SPOTTRAIN_SERVICEUSAGE_API": fake.serviceusage_api, "SPOTTRAIN_CRM_API": fake.crm_api,
               "SPOTTRAIN_BILLING_API": fake.billing_api, "GCE_METADATA_HOST": f"127.0.0.1:{free_port()}",
               "NO_GCE_CHECK": "True", "HOME": str(tmp_path)}
        yield fake, env


Preflight = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def preflight(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Preflight:
    """`python -m stacks.preflight TARGET` with ``env``: its `main` in this process (the environment
    set through monkeypatch, the output through capsys; a synthesis costs 0.5 CPU-seconds here
    against 5 in a fresh interpreter), or with ``process=True`` a real process (what `make
    preflight` runs: its exit status, no traceback)."""

    def run(env: dict[str, str], target: Path = EXAMPLE, process: bool = False) -> subprocess.CompletedProcess[str]:
        if process:
            return subprocess.run([sys.executable, "-m", "stacks.preflight", str(target)], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=120)
        from stacks.preflight import main

        for k, v in env.items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        code = main([str(target)])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["stacks.preflight", str(target)], code, out.out, out.err)

    return run


def test_every_check_passes_against_a_ready_project(gcp, preflight: Preflight) -> None:
    fake, env = gcp
    out = preflight(env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert ("  ok   apis: enabled: compute.googleapis.com, iam.googleapis.com, storage.googleapis.com, "
            "run.googleapis.com, cloudscheduler.googleapis.com") in lines
    assert "  ok   quota: PREEMPTIBLE_NVIDIA_L4_GPUS in us-central1: 4 free of 4, 1 needed" in lines
    assert "  ok   machine type: g2-standard-8 offered in us-central1-a" in lines
    assert f"  ok   image: {IMAGE[0]}/{IMAGE[1]} -> {IMAGE[1]}-v20260101" in lines
    assert "  ok   spot obtainability: g2-standard-8 in us-central1-a: 0.90 (estimated uptime 3600s)" in lines
    assert any(line.startswith("  ok   permissions: all ") and line.endswith(" on project my-project-123456")
               for line in lines), lines
    # The real protocol: a refreshed ADC token on every call, the capacity advice asked for Spot.
    assert fake.calls_to("POST", "/token")
    (advice,) = fake.calls_to("POST", "/advice/capacity")
    assert advice.body["instanceProperties"]["scheduling"]["provisioningModel"] == "SPOT"


def test_what_the_api_would_refuse_is_a_failure_and_a_stockout_a_warning(gcp, tmp_path: Path, preflight: Preflight) -> None:
    fake, env = gcp
    fake.services["storage.googleapis.com"] = "DISABLED"
    fake.regions["us-central1"]["quotas"]["PREEMPTIBLE_NVIDIA_L4_GPUS"] = 0
    fake.machine_types["us-central1-a"].discard("g2-standard-8")
    fake.images.clear()
    fake.capacity = lambda zone, model: model != "SPOT"
    out = preflight(env)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert "FAIL apis: not enabled: storage.googleapis.com (gcloud services enable storage.googleapis.com" in text
    assert "FAIL quota: PREEMPTIBLE_NVIDIA_L4_GPUS in us-central1: 0 free of 0, 1 needed" in text
    assert "FAIL machine type: g2-standard-8 is not offered in us-central1-a" in text
    assert f"FAIL image: family {IMAGE[0]}/{IMAGE[1]} resolves to no image" in text
    assert "warn spot obtainability: g2-standard-8 in us-central1-a: 0.10" in text


def test_an_api_error_is_one_line_not_a_traceback(gcp, preflight: Preflight) -> None:
    fake, env = gcp
    fake.deny("GET", r"/regions/us-central1$")
    out = preflight(env, process=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "FAIL quota: the API answered 403 PERMISSION_DENIED" in out.stdout


def test_without_credentials_it_says_what_it_would_check(tmp_path: Path, preflight: Preflight) -> None:
    env = {**os.environ, "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing.json"),
           "GCE_METADATA_HOST": f"127.0.0.1:{free_port()}", "NO_GCE_CHECK": "True", "HOME": str(tmp_path)}
    out = preflight(env, Path("example"))  # a name, as `make deploy EXPERIMENT=example` takes it
    assert out.returncode == 3
    assert "Traceback" not in out.stderr
    assert "no usable application-default credentials" in out.stderr
    assert "gcloud auth application-default login" in out.stderr
    assert "example: GPU quota PREEMPTIBLE_NVIDIA_L4_GPUS in us-central1: 1 needed" in out.stderr
    assert "example: Spot obtainability of g2-standard-8 per zone (capacity advice)" in out.stderr


def test_a_bad_experiment_file_is_bad_input(tmp_path: Path, preflight: Preflight) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE.read_text().replace("steps = 20000", "steps = -1"))
    out = preflight(dict(os.environ), bad, process=True)
    assert out.returncode == 2 and "bad.toml: trainer.steps" in out.stderr


def test_the_deployers_permissions_come_from_the_stack_and_a_budget_needs_the_billing_accounts(
        gcp, tmp_path: Path, preflight: Preflight) -> None:
    """A budget needs billing.budgets.create on the billing account, which no project role grants:
    the project's Owner alone fails, naming what is missing and where; a role on the account passes.
    What is tested on the project is what the synthesized stack's resource types need."""
    from drill.iam import DEPLOYER
    from stacks import permissions
    from stacks.load import load_file
    from stacks.stack import synthesized

    fake, env = gcp
    account = "012345-6789AB-CDEF01"
    exp = tmp_path / "budgeted.toml"
    exp.write_text(EXAMPLE.read_text() + f'\n[budget]\nbilling_account = "{account}"\namount_usd = 100\n')
    out = preflight(env, exp)
    assert out.returncode == 1, out.stdout + out.stderr
    assert (f"  FAIL permissions: missing on billing account {account}: billing.budgets.create (google_billing_budget), "
            "billing.budgets.delete (google_billing_budget), billing.budgets.get (google_billing_budget), "
            "billing.budgets.update (google_billing_budget); a role that grants them: roles/billing.costsManager"
            ) in out.stdout.splitlines()
    tested = [c.body["permissions"] for c in fake.calls_to("POST", ":testIamPermissions") if "projects/" in c.path]
    ef = load_file(exp)
    want = permissions.needed(synthesized(ef.name, ef.spec)).permissions(permissions.PROJECT)
    assert sorted(p for batch in tested for p in batch) == want
    assert {"logging.logMetrics.create", "monitoring.alertPolicies.create", "monitoring.dashboards.create",
            "serviceusage.services.use"} <= set(want)

    fake.policy.grant(DEPLOYER, "roles/billing.costsManager", f"billingAccounts/{account}")
    out = preflight(env, exp)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"  ok   permissions: all 4 the stack needs on billing account {account}" in out.stdout.splitlines()


def test_every_resource_type_the_stacks_use_has_its_permissions() -> None:
    from stacks import apis, permissions

    assert set(apis.SERVICE_OF) <= set(permissions.NEEDS)
    with pytest.raises(permissions.UnknownResourceType, match="google_new_thing: no permissions known"):
        permissions.needed({"resource": {"google_new_thing": {"x": {}}}})
