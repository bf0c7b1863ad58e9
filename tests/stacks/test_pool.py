"""A `[pool]`: Spot workers plus an on-demand coordinator, synthesized for real, its torchrun
command line rendered and run, every validation rule, the budget and the cost of a pool."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from stack_support import FIXTURES, Synthesized, merged, unless_stopped, variant

from stacks import checkov, cost, pricing
from stacks.boot import DEVICE_NAME, boot_props, render, shquote
from stacks.budget import estimate
from stacks.load import ExperimentError, ExperimentFile, parse

ROOT = Path(__file__).resolve().parents[2]
SHELLCHECK = str(Path(sys.prefix) / "bin" / "shellcheck")
SRC = "experiments/x.toml"
POOL = {"min_nodes": 2, "max_nodes": 4}

# A CPU-only coordinator that hosts the rendezvous only (not a fixture file: one stack is enough
# for the folder tests; this one is synthesized and checked here).
RENDEZVOUS_ONLY = {"pool": {"min_nodes": 1, "max_nodes": 3, "coordinator_trains": False}}


def ref(s: Synthesized, kind: str) -> str:
    """The address prefix of the one resource of `kind` (of the accounts: the trainer's)."""
    (key,) = [k for k, r in s.json["resource"][kind].items()
              if kind != "google_service_account" or r["account_id"].endswith("-trainer")]
    return f"${{{kind}.{key}"


@pytest.fixture(scope="module")
def pooled(synthesized) -> Synthesized:
    return synthesized["l4-pool"]


@pytest.fixture(scope="module")
def rendezvous_only() -> Synthesized:
    return Synthesized("cpu-coord", variant(RENDEZVOUS_ONLY, "cpu-coord"))


@pytest.fixture(scope="module")
def stopped() -> Synthesized:
    return Synthesized("stopped", variant({"pool": POOL, "group": {"workers": 0}}, "stopped"))


# --- the stack -----------------------------------------------------------------------------------

pytestmark = pytest.mark.xdist_group("stacks")


def test_single_vm_stacks_have_no_pool_resources(example):
    for kind in ("google_compute_instance", "google_compute_address", "google_compute_disk",
                 "google_dns_managed_zone", "google_dns_record_set"):
        assert example.resources(kind) == []
    assert "spottrain-role" not in example.text
    assert "torch.distributed.run" not in example.text


def test_coordinator_is_on_demand_private_with_a_static_internal_ip(pooled):
    vm = pooled.one("google_compute_instance")
    assert vm["name"] == "l4-pool-coordinator"
    assert vm["zone"] == "us-central1-a"
    assert vm["machine_type"] == "g2-standard-8"  # trains: the workers' machine by default
    assert vm["scheduling"] == {"provisioning_model": "STANDARD", "preemptible": False,
                                "automatic_restart": True, "on_host_maintenance": "TERMINATE"}
    (nic,) = vm["network_interface"]
    assert "access_config" not in nic
    assert nic["subnetwork"] == f"{ref(pooled, 'google_compute_subnetwork')}.id}}"
    address = pooled.one("google_compute_address")
    assert address["address_type"] == "INTERNAL"
    assert address["name"] == "l4-pool-coordinator"
    assert address["subnetwork"] == nic["subnetwork"]
    assert nic["network_ip"] == f"{ref(pooled, 'google_compute_address')}.address}}"
    assert vm["service_account"]["email"] == f"{ref(pooled, 'google_service_account')}.email}}"
    assert vm["shielded_instance_config"] == {
        "enable_secure_boot": False, "enable_vtpm": True, "enable_integrity_monitoring": True}
    assert unless_stopped(vm["desired_status"]) == "RUNNING"
    assert vm["tags"] == ["l4-pool-trainer"]  # IAP SSH reaches it like the workers


def test_coordinator_has_its_own_checkpoint_disk_and_the_workers_boot_scripts(pooled):
    vm = pooled.one("google_compute_instance")
    disk = pooled.one("google_compute_disk")
    assert (disk["type"], disk["size"], disk["zone"]) == ("pd-ssd", 1000, "us-central1-a")
    assert vm["attached_disk"] == [{"source": f"{ref(pooled, 'google_compute_disk')}.id}}",
                                    "device_name": DEVICE_NAME, "mode": "READ_WRITE"}]
    template = pooled.one("google_compute_instance_template")
    # The same scripts; the role in the metadata picks the part.
    assert vm["metadata_startup_script"] == template["metadata"]["startup-script"]
    assert vm["metadata"]["shutdown-script"] == template["metadata"]["shutdown-script"]
    assert vm["metadata"]["spottrain-role"] == "coordinator"
    assert template["metadata"]["spottrain-role"] == "worker"
    assert vm["metadata"]["install-nvidia-driver"] == "True"
    # Waits for the same grants and code objects as the group.
    group = pooled.one("google_compute_instance_group_manager")
    assert set(group["depends_on"]) < set(vm["depends_on"])
    assert any(d.startswith("google_storage_bucket_object.") for d in vm["depends_on"])


def test_dns_name_points_at_the_coordinators_static_ip(pooled):
    zone = pooled.one("google_dns_managed_zone")
    assert zone["visibility"] == "private"
    assert zone["dns_name"] == "l4-pool.spottrain.internal."
    assert zone["private_visibility_config"] == {"networks": [
        {"network_url": f"{ref(pooled, 'google_compute_network')}.id}}"}]}
    record = pooled.one("google_dns_record_set")
    assert record["name"] == "coordinator.l4-pool.spottrain.internal."
    assert record["type"] == "A"
    assert record["rrdatas"] == [f"{ref(pooled, 'google_compute_address')}.address}}"]
    assert record["managed_zone"] == f"{ref(pooled, 'google_dns_managed_zone')}.name}}"
    out = {k: v["value"] for k, v in pooled.json["output"].items()}
    assert out["rendezvous_endpoint"] == "coordinator.l4-pool.spottrain.internal:29500"


def test_private_zone_has_no_logging_config_and_a_dns_policy_logs_queries(pooled, example,
                                                                         synthesized):
    """A private zone refuses cloud_logging_config (public zones only); query logging is a DNS
    policy on the network: on for a pool on its own network, off where the network is not the
    stack's (one policy per network) unless asked, and absent from single-VM stacks."""
    for s in synthesized.values():
        for zone in s.resources("google_dns_managed_zone"):
            assert zone["visibility"] == "private" and "cloud_logging_config" not in zone
    policy = pooled.one("google_dns_policy")
    assert policy["enable_logging"] is True
    assert policy["networks"] == [
        {"network_url": f"{ref(pooled, 'google_compute_network')}.id}}"}]
    assert example.resources("google_dns_policy") == []
    from stack_support import VARIANTS

    shared = {**VARIANTS["existing-net"], "pool": POOL}
    assert variant(shared).dns_query_logging is False
    asked = variant({**shared, "network": {**shared["network"], "dns_query_logging": True}})
    assert asked.dns_query_logging is True
    assert variant({"pool": POOL, "network": {"dns_query_logging": False}}).dns_query_logging \
        is False


def test_workers_are_spot_and_the_group_holds_every_node_but_the_coordinator(pooled):
    template = pooled.one("google_compute_instance_template")
    assert template["scheduling"]["provisioning_model"] == "SPOT"
    assert unless_stopped(pooled.one("google_compute_instance_group_manager")["target_size"]) == 3  # 4 - 1


def test_workers_may_miss_health_probes_while_the_world_is_re_formed(pooled, example):
    """A survivor answers no health probe between losing a peer and training again; autohealing
    must not recreate it meanwhile (last call 45 s in the fixture: 3 + 45 + 60 = 108 s of failed
    probes). The API takes at most 10 failures, so the pool probes less often instead."""
    hc = pooled.one("google_compute_health_check")
    assert hc["unhealthy_threshold"] <= 10 and hc["timeout_sec"] <= hc["check_interval_sec"] <= 300
    assert hc["unhealthy_threshold"] * hc["check_interval_sec"] >= 3 + 45 + 60
    assert (hc["check_interval_sec"], hc["unhealthy_threshold"]) == (11, 10)
    single = example.one("google_compute_health_check")
    assert (single["check_interval_sec"], single["unhealthy_threshold"]) == (10, 6)


@pytest.mark.parametrize("last_call", [0, 10, 37, 38, 45, 100, 1000, 2937])
def test_every_last_call_validation_accepts_has_a_health_check_the_api_accepts(last_call):
    from stacks import gcp_rules as R
    from stacks.health import pool_timing

    t = pool_timing(last_call)
    assert R.HEALTH_THRESHOLD_MIN <= t.unhealthy_threshold <= R.HEALTH_THRESHOLD_MAX
    assert R.HEALTH_INTERVAL_MIN_S <= t.timeout_s <= t.interval_s <= R.HEALTH_INTERVAL_MAX_S
    assert t.tolerated_s >= 3 + last_call + 60
    assert t.unhealthy_threshold >= 6 and t.interval_s >= 10  # never quicker than a single VM
    assert variant({"pool": {**POOL, "rendezvous_last_call_s": last_call}}, "x").pool is not None


def test_the_documented_last_call_limit_is_the_computed_one():
    from stacks.experiment import Pool
    from stacks.health import MAX_LAST_CALL_S

    doc = Pool.model_fields["rendezvous_last_call_s"].description
    assert f"At most {MAX_LAST_CALL_S}:" in " ".join(doc.split())


def test_a_coordinator_that_does_not_train_leaves_every_node_to_the_group(rendezvous_only):
    s = rendezvous_only
    assert unless_stopped(s.one("google_compute_instance_group_manager")["target_size"]) == 3
    vm = s.one("google_compute_instance")
    assert vm["machine_type"] == "e2-standard-4"
    assert "guest_accelerator" not in vm and "install-nvidia-driver" not in vm["metadata"]
    assert vm["scheduling"]["on_host_maintenance"] == "MIGRATE"  # no GPU: live migration


def test_workers_zero_stops_the_whole_pool(stopped):
    assert stopped.one("google_compute_instance_group_manager")["target_size"] == 0
    assert stopped.one("google_compute_instance")["desired_status"] == "TERMINATED"
    # Stopped, not deleted: the disk and the address stay.
    assert stopped.resources("google_compute_disk") and stopped.resources("google_compute_address")


def test_pool_firewall_admits_only_the_experiments_own_account(pooled):
    rules = {r["name"]: r for r in pooled.resources("google_compute_firewall")}
    rule = rules["l4-pool-allow-pool"]
    sa = f"{ref(pooled, 'google_service_account')}.email}}"
    assert rule["direction"] == "INGRESS"
    assert rule["source_service_accounts"] == [sa]
    assert rule["target_service_accounts"] == [sa]
    assert rule["allow"] == [{"protocol": "tcp"}]  # rendezvous + ephemeral collective ports
    assert "source_ranges" not in rule and "source_tags" not in rule
    assert rule["log_config"] == {"metadata": "INCLUDE_ALL_METADATA"}
    assert "0.0.0.0/0" not in pooled.text


def test_no_new_project_roles_for_a_pool(pooled):
    """DNS resolution, metadata and the rendezvous need no IAM: the trainer's account still has
    logs, metrics and the bucket (stopping the coordinator is the control job's, on that VM alone:
    tests/stacks/test_scale_to_zero.py)."""
    member = f"serviceAccount:{ref(pooled, 'google_service_account')}.email}}"
    roles = {m["role"] for m in pooled.resources("google_project_iam_member") if m["member"] == member}
    assert roles == {"roles/logging.logWriter", "roles/monitoring.metricWriter"}
    (bucket,) = [g for g in pooled.resources("google_storage_bucket_iam_member") if g["member"] == member]
    assert bucket["role"] == "roles/storage.objectAdmin"


def test_checkov_clean_on_a_rendezvous_only_pool(rendezvous_only):
    result = checkov.run([rendezvous_only.file])
    assert result["failed"] == [] and result["parsing_errors"] == 0
    assert result["passed"] >= 30


# --- the boot scripts ----------------------------------------------------------------------------


class _Role(http.server.BaseHTTPRequestHandler):
    role: str | None = None

    def do_GET(self) -> None:  # noqa: N802
        if (self.path.endswith("/instance/attributes/spottrain-role") and self.role is not None
                and self.headers.get("Metadata-Flavor") == "Google"):
            body = self.role.encode()
            self.send_response(200)
        else:
            body = b"not found"
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:  # noqa: N802  (guest attributes)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metadata() -> Iterator[type[_Role]]:
    handler = type("Role", (_Role,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.host = f"127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield handler
    server.shutdown()
    server.server_close()


def run_trainer_sh(tmp_path: Path, trainer_sh: str, metadata_host: str) -> tuple[int, list[str]]:
    """trainer.sh under bash with a python3 that records its argv and exits 3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    argv = tmp_path / "argv"
    fake = bin_dir / "python3"
    store_env = tmp_path / "share-store-env"
    # `python3 -m trainer rendezvous-id` (a worker of a pool whose coordinator does not train)
    # records its own argv and prints an id with an epoch.
    fake.write_text(f"#!/bin/bash\nif [[ \"$1 $2 $3\" == '-m trainer rendezvous-id' ]]; then\n"
                    f"  printf '%s\\0' \"$@\" > {shquote(tmp_path / 'rdzv-id-argv')}; echo cpu-coord-7; exit 0\nfi\n"
                    f"printf '%s\\0' \"$@\" > {shquote(argv)}\n"
                    f"printf '%s' \"${{TORCH_DISABLE_SHARE_RDZV_TCP_STORE-unset}}\" > {shquote(store_env)}\n"
                    "exit 3\n")
    fake.chmod(0o755)
    script = tmp_path / "trainer.sh"
    script.write_text(trainer_sh)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "GCE_METADATA_HOST": metadata_host}
    env.pop("SPOTTRAIN_PYTHON", None)
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, timeout=60)
    args = [a.decode() for a in argv.read_bytes().split(b"\0")[:-1]] if argv.exists() else []
    return proc.returncode, args


def pooled_scripts(overrides: dict, name: str = "l4-pool"):
    exp = (parse(merged({}, _fixture_data()), name) if not overrides
           else variant(overrides, name))
    return exp, render(boot_props(name, exp, workdir="/nonexistent-not-used"))


def _fixture_data() -> dict:
    import tomllib

    return tomllib.loads((FIXTURES / "l4-pool.toml").read_text())


TORCHRUN = ["-m", "torch.distributed.run", "--nnodes=2:4", "--nproc-per-node=1",
            "--rdzv-backend=c10d", "--rdzv-endpoint=coordinator.l4-pool.spottrain.internal:29500",
            "--rdzv-id=l4-pool"]


@pytest.mark.parametrize(("role", "is_host"), [("coordinator", "true"), ("worker", "false")])
def test_torchrun_command_line_per_role(tmp_path, metadata, role, is_host):
    exp, scripts = pooled_scripts({})
    metadata.role = role
    (tmp_path / "work").mkdir()
    rc, argv = run_trainer_sh(tmp_path, scripts.trainer_sh.replace(
        "cd /nonexistent-not-used", f"cd {shquote(tmp_path / 'work')}"), metadata.host)
    assert rc == 3  # torchrun's exit status (here the fake's), passed on
    # A node coming back must be able to rejoin (torch 2.13's shared store breaks that).
    assert (tmp_path / "share-store-env").read_text() == "1"
    # The coordinator runs on demand: its ledger records its own on-demand price.
    prices = {"coordinator": pricing.coordinator_price_args(exp),
              "worker": pricing.trainer_price_args(exp)}
    assert prices["coordinator"][1] == prices["coordinator"][3] != prices["worker"][1]
    assert argv == [
        *TORCHRUN, f"--rdzv-conf=is_host={is_host},join_timeout=600,last_call_timeout=45,keep_alive_interval=1,keep_alive_max_attempt=3", "--max-restarts=50",
        "-m", "trainer", "run", "--run-dir", "/mnt/spottrain/run", "--steps", "20000",
        "--gcs-uri", "gs://my-project-123456-l4-pool-ckpt/runs/l4-pool",
        "--task", "trainer.tasks.gpt:build", "--health-port", "8471", "--startup-grace-s", "900",
        # Every trainer of a pool: the workers' (Spot) budget (tests/stacks/test_shutdown_window.py).
        "--preemption-budget-s", "20",
        # The VM's trainer config: the stack's sinks (Cloud Monitoring's custom metrics).
        "--config", "/etc/spottrain/trainer.toml",
        "--checkpoint-key-file", "/run/spottrain/checkpoint.key", "--parallelism", "fsdp",
        *prices[role], "--checkpoint-every-steps", "500",
    ]
    # What torchrun and the trainer make of it: their own, real argument parsers.
    from torch.distributed.run import get_args_parser

    from trainer.cli import parser

    t = get_args_parser().parse_args(argv[2:])
    assert (t.nnodes, t.nproc_per_node, t.rdzv_backend, t.rdzv_endpoint, t.rdzv_id) == (
        "2:4", "1", "c10d", "coordinator.l4-pool.spottrain.internal:29500", "l4-pool")
    assert t.rdzv_conf == f"is_host={is_host},join_timeout=600,last_call_timeout=45,keep_alive_interval=1,keep_alive_max_attempt=3"
    assert (t.max_restarts, t.module, t.training_script) == (50, True, "trainer")
    # ... and what the c10d rendezvous handler reads from --rdzv-conf and --rdzv-endpoint.
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import (
        _parse_rendezvous_config,
        parse_rendezvous_endpoint,
    )

    params = RendezvousParameters(backend=t.rdzv_backend, endpoint=t.rdzv_endpoint,
                                  run_id=t.rdzv_id, min_nodes=2, max_nodes=4,
                                  **_parse_rendezvous_config(t.rdzv_conf))
    assert params.get_as_bool("is_host") is (is_host == "true")
    assert params.get_as_int("last_call_timeout") == 45
    # What the c10d handler reads as its join timeout (stacks.pool.JOIN_TIMEOUT_S says why 600).
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _get_timeout

    assert _get_timeout(params, "join").total_seconds() == 600
    # The coordinator's own agent hosts the store: the fixed id (trainer.sh says why).
    assert not (tmp_path / "rdzv-id-argv").exists()
    # A lost node leaves the next rendezvous round after 3 missed 1 s heartbeats, not torch's 15 s
    # (bench/elastic_bench.py: 2.2 s instead of 10.4 s of rendezvous after a power-off).
    assert (params.get_as_int("keep_alive_interval"), params.get_as_int("keep_alive_max_attempt")) == (1, 3)
    assert parse_rendezvous_endpoint(t.rdzv_endpoint, default_port=29400) == (
        "coordinator.l4-pool.spottrain.internal", 29500)
    args = parser().parse_args(t.training_script_args)
    assert (args.command, args.parallelism, args.gcs_uri) == (
        "run", "fsdp", "gs://my-project-123456-l4-pool-ckpt/runs/l4-pool")
    assert args.price_per_hour == float(prices[role][1])


def test_a_coordinator_that_does_not_train_serves_the_rendezvous(tmp_path, metadata):
    _, scripts = pooled_scripts(RENDEZVOUS_ONLY, "cpu-coord")
    (tmp_path / "work").mkdir()
    sh = scripts.trainer_sh.replace("cd /nonexistent-not-used",
                                    f"cd {shquote(tmp_path / 'work')}")
    metadata.role = "coordinator"
    rc, argv = run_trainer_sh(tmp_path, sh, metadata.host)
    assert (rc, argv) == (3, ["-m", "trainer", "rendezvous", "--port", "29400"])
    from trainer.cli import parser

    args = parser().parse_args(argv[2:])  # the trainer's own parser accepts it
    assert (args.command, args.port) == ("rendezvous", 29400)
    # Its workers train with torchrun, none of them hosting the store.
    metadata.role = "worker"
    rc, argv = run_trainer_sh(tmp_path, sh, metadata.host)
    assert rc == 3
    assert argv[:9] == ["-m", "torch.distributed.run", "--nnodes=1:3", "--nproc-per-node=1",
                        "--rdzv-backend=c10d",
                        "--rdzv-endpoint=coordinator.cpu-coord.spottrain.internal:29400",
                        # The id the store gave (tests/trainer/test_rendezvous.py: the epochs).
                        "--rdzv-id=cpu-coord-7", "--rdzv-conf=is_host=false,join_timeout=600,last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3",
                        "--max-restarts=100"]
    ask = [a.decode() for a in (tmp_path / "rdzv-id-argv").read_bytes().split(b"\0")[:-1]]
    assert ask == ["-m", "trainer", "rendezvous-id", "--endpoint",
                   "coordinator.cpu-coord.spottrain.internal:29400", "--name", "cpu-coord"]
    args = parser().parse_args(ask[2:])
    assert (args.command, args.endpoint, args.name) == (
        "rendezvous-id", "coordinator.cpu-coord.spottrain.internal:29400", "cpu-coord")
    # The startup script does not wait for a GPU driver on the CPU-only coordinator.
    assert 'if [[ "$role" == coordinator ]]; then' in scripts.startup
    assert "no GPU, no driver to wait for" in scripts.startup


@pytest.mark.parametrize("role", [None, "boss"])
def test_an_unknown_role_starts_nothing(tmp_path, metadata, role):
    _, scripts = pooled_scripts({})
    metadata.role = role
    rc, argv = run_trainer_sh(tmp_path, scripts.trainer_sh, metadata.host)
    assert rc == 1 and argv == []


@pytest.mark.parametrize("overrides", [{}, RENDEZVOUS_ONLY,
                                       {"pool": POOL, "disk": {"local_ssd_count": 0}}])
def test_pooled_scripts_pass_shellcheck(tmp_path, overrides):
    _, scripts = pooled_scripts(overrides, "l4-pool" if not overrides else "p")
    files = []
    for key in ("startup", "shutdown", "trainer_sh"):
        f = tmp_path / f"{key}.sh"
        f.write_text(getattr(scripts, key))
        files.append(str(f))
    proc = subprocess.run([SHELLCHECK, "--shell=bash", *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_join_timeout_cannot_exhaust_the_units_starts():
    """A survivor whose join times out in a long stockout exits 1 and its unit restarts it: the
    unit's start limit must never stop it for good (stacks.pool.JOIN_TIMEOUT_S)."""
    import re

    from stacks.pool import JOIN_TIMEOUT_S

    _, scripts = pooled_scripts({})
    unit = scripts.unit  # the rendered spottrain.service
    interval = int(re.search(r"^StartLimitIntervalSec=(\d+)$", unit, re.M).group(1))
    burst = int(re.search(r"^StartLimitBurst=(\d+)$", unit, re.M).group(1))
    restart = int(re.search(r"^RestartSec=(\d+)$", unit, re.M).group(1))
    # burst + 1 starts within the interval stop the unit: at most `burst` fit when each start
    # comes join timeout + RestartSec after the one before.
    assert burst * (JOIN_TIMEOUT_S + restart) > interval


def test_parallelism_reaches_a_single_vm_only_when_set():
    assert boot_props("example", variant({})).parallelism is None
    assert boot_props("x", variant({"trainer": {"parallelism": "fsdp"}}, "x")).parallelism == \
        "fsdp"
    assert boot_props("x", variant({"pool": POOL}, "x")).parallelism == "ddp"


# --- validation ----------------------------------------------------------------------------------

RULES = [
    ("min-above-max", {"pool": {"min_nodes": 5, "max_nodes": 4}},
     "pool.min_nodes: 5 is more than max_nodes (4); allowed: 1 to 4"),
    ("min-nodes-positive", {"pool": {"min_nodes": 0, "max_nodes": 4}},
     "pool.min_nodes: Input should be greater than or equal to 1, got 0"),
    ("max-nodes-required", {"pool": {"min_nodes": 1}}, "pool.max_nodes: is required"),
    ("port-privileged", {"pool": {**POOL, "rendezvous_port": 80}},
     "pool.rendezvous_port: Input should be greater than or equal to 1024, got 80"),
    ("port-max", {"pool": {**POOL, "rendezvous_port": 70000}},
     "pool.rendezvous_port: Input should be less than or equal to 65535, got 70000"),
    ("port-clashes-with-health", {"pool": {**POOL, "rendezvous_port": 8471}},
     "pool.rendezvous_port: 8471 is also trainer.health_port; allowed: another port in "
     "1024-65535"),
    ("max-restarts-negative", {"pool": {**POOL, "max_restarts": -1}},
     "pool.max_restarts: Input should be greater than or equal to 0, got -1"),
    ("last-call-negative", {"pool": {**POOL, "rendezvous_last_call_s": -5}},
     "pool.rendezvous_last_call_s: Input should be greater than or equal to 0, got -5"),
    ("last-call-beyond-any-health-check", {"pool": {**POOL, "rendezvous_last_call_s": 2938}},
     "pool.rendezvous_last_call_s: 2938 s cannot be tolerated by the workers' health check (the "
     "last call plus 63 s of failed probes; the Compute API takes at most 10 probes 300 s apart); "
     "allowed: 0 to 2937"),
    ("coordinator-gpu-count-mismatch", {"pool": {**POOL,
                                                 "coordinator_machine_type": "g2-standard-24"}},
     "pool.coordinator_machine_type: the coordinator trains with the workers' 1 x nvidia-l4 on "
     "demand: g2-standard-24 has 2 GPU(s) built in, not 1; allowed: 2 (pick another size for "
     "more)"),
    ("coordinator-gpu-type-mismatch", {"pool": {**POOL,
                                                "coordinator_machine_type": "a2-highgpu-1g"}},
     "pool.coordinator_machine_type: the coordinator trains with the workers' 1 x nvidia-l4 on "
     "demand: a2-highgpu-1g has nvidia-tesla-a100 built in, not 'nvidia-l4'; allowed: "
     "\"nvidia-tesla-a100\""),
    ("coordinator-spot-only-machine", {
        "machine": {"machine_type": "a3-highgpu-1g", "gpu_type": "nvidia-h100-80gb"},
        "pool": POOL},
     "pool.coordinator_machine_type: the coordinator trains with the workers' 1 x "
     "nvidia-h100-80gb on demand: a3-highgpu-1g is offered only as Spot (or flex-start); "
     "allowed: \"spot\", or a3-highgpu-8g for standard"),
    ("coordinator-cpu-cannot-train", {"pool": {**POOL,
                                               "coordinator_machine_type": "e2-standard-4"}},
     "pool.coordinator_machine_type: the coordinator trains with the workers' 1 x nvidia-l4 on "
     "demand: unknown machine type 'e2-standard-4'; allowed: families a2, a3, g2, n1"),
    ("rendezvous-only-needs-cpu", {"pool": {**POOL, "coordinator_trains": False,
                                            "coordinator_machine_type": "g2-standard-8"}},
     "pool.coordinator_machine_type: 'g2-standard-8' is not a machine type without GPUs, which "
     "a coordinator that does not train needs; allowed: e2-standard-2, -4, -8, -16, -32 or an "
     "n1 type, e.g. \"e2-standard-4\""),
    ("coordinator-required", {"pool": {**POOL, "coordinator": False}},
     "pool.coordinator: false is not supported: the rendezvous needs a host that is never "
     "preempted; allowed: true (with coordinator_trains = false for a small CPU-only host)"),
    ("unknown-pool-key", {"pool": {**POOL, "nodes": 3}},
     "pool.nodes: unknown key; allowed: min_nodes, max_nodes, coordinator, coordinator_trains, "
     "coordinator_machine_type, rendezvous_port, max_restarts, rendezvous_last_call_s"),
    ("parallelism-enum", {"trainer": {"parallelism": "tp"}},
     "trainer.parallelism: Input should be 'ddp' or 'fsdp', got 'tp'"),
    ("global-batch-not-divisible", {"pool": {"min_nodes": 2, "max_nodes": 4},
                                    "trainer": {"args": ["--global-batch-size", "30"]}},
     "trainer.args[0]: --global-batch-size 30 is not divisible by the world size(s) [4] this pool "
     "can run at (gpu_count x 2..4 nodes; divisible: [2, 3]); allowed: a multiple of 12"),
    ("global-batch-not-a-number", {"pool": POOL, "trainer": {"args": ["--global-batch-size=lots"]}},
     "trainer.args[0]: --global-batch-size needs a whole number, got 'lots'"),
    ("parallelism-is-managed", {"trainer": {"args": ["--parallelism=fsdp"]}},
     "trainer.args[0]: --parallelism is set by the stack from other fields; allowed: any other "
     "flag"),
]


@pytest.mark.parametrize(("overrides", "line"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(overrides, line):
    with pytest.raises(ExperimentError) as info:
        parse(merged(overrides), "x", SRC)
    assert f"{SRC}: {line}" in info.value.lines


def test_valid_pools():
    for overrides in ({"pool": POOL}, RENDEZVOUS_ONLY,
                      {"pool": {"min_nodes": 1, "max_nodes": 1}},  # the coordinator alone
                      {"pool": {**POOL, "coordinator_trains": False,
                                "coordinator_machine_type": "n1-standard-4"}}):
        assert variant(overrides, "x").pool is not None


def test_a_bad_pool_exits_2_naming_file_and_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((FIXTURES / "l4-pool.toml").read_text()
                   .replace("min_nodes = 2", "min_nodes = 6")
                   .replace("rendezvous_port = 29500", "rendezvous_port = 8471")
                   .replace("rendezvous_last_call_s = 45", "rendezvous_last_call_s = 3600"))
    env = {**os.environ, "SPOTTRAIN_EXPERIMENTS": str(bad), "CDKTF_OUTDIR": str(tmp_path / "o")}
    proc = subprocess.run([sys.executable, str(ROOT / "main.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"{bad}: pool.min_nodes: 6 is more than max_nodes (4); allowed: 1 to 4",
        f"{bad}: pool.rendezvous_last_call_s: 3600 s cannot be tolerated by the workers' health "
        "check (the last call plus 63 s of failed probes; the Compute API takes at most 10 probes "
        "300 s apart); allowed: 0 to 2937",
        f"{bad}: pool.rendezvous_port: 8471 is also trainer.health_port; allowed: another port "
        "in 1024-65535",
    ]
    assert not (tmp_path / "o").exists()


# --- budget and cost -----------------------------------------------------------------------------


def test_fsdp_budget_counts_one_nodes_shards_at_the_smallest_world():
    # 8 GPUs a node, 2 nodes at least: 16 ranks; a node writes 8 shards of 1/16 = half the state.
    over = {"machine": {"machine_type": "a3-highgpu-8g", "gpu_type": "nvidia-h100-80gb",
                        "gpu_count": 8},
            "trainer": {"param_count": None, "state_bytes": 16_000_000_000, "parallelism": "fsdp"},
            "pool": {"min_nodes": 2, "max_nodes": 4}}
    b = estimate(variant(over))
    assert b.state_bytes == 8_000_000_000
    assert "1.00 GB per rank at the smallest world (2 nodes x 8 GPUs)" in b.describe()
    ddp = estimate(variant({**over, "trainer": {**over["trainer"], "parallelism": "ddp"}}))
    assert ddp.state_bytes == 16_000_000_000  # rank 0 writes it all
    assert "ddp: rank 0's node writes it all" in ddp.describe()
    single = estimate(variant({k: v for k, v in over.items() if k != "pool"}))
    assert single.state_bytes == 16_000_000_000


def test_pool_cost_is_the_coordinator_on_demand_plus_spot_workers():
    exp = variant({"pool": POOL, "cost": {"spot_per_hour": 1.0, "on_demand_per_hour": 3.0}})
    q = pricing.pool_quote(exp)
    assert (q.min_workers, q.max_workers, q.coordinator) == (1, 3, 3.0)
    assert (q.hourly(1), q.hourly(3), q.on_demand_hourly(3)) == (4.0, 6.0, 12.0)
    cpu = pricing.pool_quote(variant(RENDEZVOUS_ONLY))
    assert cpu.coordinator == pytest.approx(
        pricing.machine_rate("e2-standard-4", "nvidia-l4", 0).on_demand
        + (200 * 0.10 + 300 * 0.17) / pricing.HOURS_PER_MONTH)
    assert (cpu.min_workers, cpu.max_workers) == (1, 3)


def test_pool_cost_lines_state_min_and_max(tmp_path):
    exp = variant({"pool": POOL, "trainer": {"steps": 36_000},
                   "cost": {"steps_per_second": 2.0, "expected_goodput": 0.8,
                            "spot_per_hour": 1.0, "on_demand_per_hour": 3.0}})
    text = "\n".join(cost.describe(ExperimentFile("x", Path("x.toml"), exp),
                                   today=pricing.CATALOG_DATE))
    # 5 h of training at 4 nodes, 6.25 h of pool at 80% goodput; twice that at 2 nodes.
    assert "pool per hour     $4.00/h at 2 nodes (coordinator + 1 workers)   $6.00/h at 4 " \
        "nodes (coordinator + 3 workers)" in text
    assert "expected cost     $50.00 at 2 nodes (12.5 h of pool) to $37.50 at 4 nodes (6.2 h)" \
        "   all on demand $60.00 at 4 nodes (5.0 h)" in text
    assert "savings           $22.50 (38%) at 4 nodes against the pool all on demand" in text


def test_cost_and_demo_commands_on_the_pooled_fixture():
    f = str(FIXTURES / "l4-pool.toml")
    run = subprocess.run([sys.executable, "-m", "stacks.cost", f], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "pool of 2-4 nodes of g2-standard-8" in run.stdout
    demo = subprocess.run([sys.executable, "-m", "stacks.demo", f], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stderr
    assert "l4-pool-allow-pool  tcp:all ports from and to the trainer service account only" in \
        demo.stdout
    assert "l4-pool-coordinator  g2-standard-8, STANDARD, role coordinator, RUNNING" in demo.stdout
    assert "rendezvous_endpoint      coordinator.l4-pool.spottrain.internal:29500" in demo.stdout


def test_example_toml_pool_block_is_valid_once_uncommented():
    """The commented [pool] example in experiments/example.toml parses when uncommented."""
    import tomllib

    text = (ROOT / "experiments" / "example.toml").read_text()
    start = text.index("# [pool]")
    block = []
    for line in text[start:].splitlines():
        if not line.startswith("# "):
            break
        block.append(line[2:])
    data = merged({"pool": tomllib.loads("\n".join(block))["pool"]})
    exp = parse(data, "example")
    assert exp.pool is not None and exp.pool.min_nodes <= exp.pool.max_nodes
    json.dumps(exp.model_dump())  # plain data


def test_pools_on_an_existing_shared_vpc_and_a_regional_group(tmp_path):
    from stack_support import VARIANTS

    shared = Synthesized("shared-pool", variant({**VARIANTS["existing-net"], "pool": POOL},
                                                "shared-pool"))
    address = shared.one("google_compute_address")
    assert address["subnetwork"] == (
        "projects/host-project-42/regions/us-central1/subnetworks/trainers")
    (nic,) = shared.one("google_compute_instance")["network_interface"]
    assert (nic["subnetwork"], nic["subnetwork_project"]) == ("trainers", "host-project-42")
    zone = shared.one("google_dns_managed_zone")
    assert zone["private_visibility_config"]["networks"] == [
        {"network_url": "projects/host-project-42/global/networks/shared-vpc"}]
    rules = {r["name"]: r for r in shared.resources("google_compute_firewall")}
    assert rules["shared-pool-allow-pool"]["project"] == "host-project-42"
    assert shared.resources("google_dns_policy") == []  # not our network: not our policy
    regional = Synthesized("regional-pool", variant({**VARIANTS["regional"], "pool": POOL},
                                                    "regional-pool"))
    g = regional.one("google_compute_region_instance_group_manager")
    assert unless_stopped(g["target_size"]) == 3
    assert regional.one("google_compute_instance")["zone"] == "us-central1-a"
    result = checkov.run([shared.file, regional.file])
    assert result["failed"] == [] and result["parsing_errors"] == 0


def test_every_pool_key_is_documented():
    from stacks.experiment import Pool, Trainer

    assert [f for f, info in Pool.model_fields.items() if not info.description] == []
    assert Trainer.model_fields["parallelism"].description
    assert Pool.model_config["extra"] == "forbid"
