"""The fake Google APIs are no kinder than Google: callers are known by their token, every call is
checked against the IAM policy, and a mutation is an operation that takes its time."""
from __future__ import annotations

from typing import Iterator

import pytest

from drill.fake_gcp import FakeGcp
from drill.iam import Policy
from trainer.cloud.gce import ApiError, Client

P, ZONE = "my-project-123456", "us-central1-a"
VM = f"serviceAccount:exp-trainer@{P}.iam.gserviceaccount.com"
GROUP = f"projects/{P}/zones/{ZONE}/instanceGroupManagers/exp-group"
RESIZER = f"projects/{P}/roles/resizer"


@pytest.fixture
def gcp() -> Iterator[FakeGcp]:
    policy = Policy(custom_roles={RESIZER: frozenset({"compute.instanceGroupManagers.get",
                                                      "compute.instanceGroupManagers.update"})})
    with FakeGcp(P, policy=policy) as fake:
        fake.add_group("exp-group", zone=ZONE, instances=("exp-0001",))
        fake.add_identity("vm-token", VM)
        yield fake


def client(fake: FakeGcp, token: str) -> Client:
    return Client(token=lambda: (token, 3600.0), compute=fake.compute_api, sleep=lambda s: None, retries=0)


def test_an_unknown_token_is_401_and_an_ungranted_call_is_googles_403(gcp) -> None:
    with pytest.raises(ApiError) as e:
        client(gcp, "stolen").compute_call("GET", GROUP)
    assert e.value.code == 401
    with pytest.raises(ApiError) as e:
        client(gcp, "vm-token").compute_call("POST", f"{GROUP}/resize", query={"size": 0})
    assert e.value.code == 403
    assert e.value.message == f"Required 'compute.instanceGroupManagers.update' permission for '{GROUP}'"
    assert gcp.refusals == [(VM, "compute.instanceGroupManagers.update", GROUP)]
    assert gcp.group("exp-group").target_size == 1


def test_a_condition_on_the_groups_name_never_grants(gcp) -> None:
    # What the stack bound before: the right role, under a condition IAM cannot evaluate for a
    # group (iam/docs/conditions-resource-attributes lists no instance group managers).
    gcp.policy.grant(VM, RESIZER, f"projects/{P}", condition=f'resource.name == "{GROUP}"')
    with pytest.raises(ApiError) as e:
        client(gcp, "vm-token").compute_call("POST", f"{GROUP}/resize", query={"size": 0})
    assert e.value.code == 403


def test_a_resize_is_pending_then_running_then_done_and_only_then_changes_the_group(gcp) -> None:
    owner = client(gcp, gcp.token)
    op = owner.compute_call("POST", f"{GROUP}/resize", query={"size": 0})
    assert op["status"] == "PENDING" and op["zone"].endswith(f"/zones/{ZONE}")
    seen = []
    for _ in range(3):
        seen.append(owner.compute_call("GET", GROUP)["targetSize"])
    assert seen == [1, 0, 0]  # RUNNING at the first look, DONE at the second
    assert [size for _, size in gcp.group("exp-group").history] == [1, 0]


def test_wait_answers_the_current_state_so_clients_must_poll(gcp) -> None:
    owner = client(gcp, gcp.token)
    op = owner.compute_call("POST", f"{GROUP}/resize", query={"size": 0})
    wait = f"projects/{P}/zones/{ZONE}/operations/{op['name']}/wait"
    assert [owner.compute_call("POST", wait)["status"] for _ in range(3)] == ["RUNNING", "DONE", "DONE"]


def test_waiting_on_the_operation_needs_a_permission_a_group_role_lacks(gcp) -> None:
    """The VM-side stop path before: resize, then wait on the operation. With the group's role
    granted outright (no condition), the resize goes through and the wait is refused."""
    gcp.policy.grant(VM, RESIZER, f"projects/{P}")
    vm = client(gcp, "vm-token")
    op = vm.compute_call("POST", f"{GROUP}/resize", query={"size": 0})
    with pytest.raises(ApiError) as e:
        vm.compute_call("POST", f"projects/{P}/zones/{ZONE}/operations/{op['name']}/wait")
    assert e.value.code == 403 and "compute.zoneOperations.get" in e.value.message
    # ...while the group's own state, which the role may read, shows the outcome.
    assert [vm.compute_call("GET", GROUP)["targetSize"] for _ in range(2)][-1] == 0


def test_a_stop_is_stopping_then_terminated_and_needs_a_grant_on_that_instance(gcp) -> None:
    coordinator = gcp.add_instance(ZONE, "exp-coordinator")
    path = f"projects/{P}/zones/{ZONE}/instances/exp-coordinator"
    vm = client(gcp, "vm-token")
    with pytest.raises(ApiError, match="compute.instances.stop"):
        vm.compute_call("POST", f"{path}/stop")
    gcp.policy.custom_roles[f"projects/{P}/roles/stopper"] = frozenset({"compute.instances.get",
                                                                         "compute.instances.stop"})
    gcp.policy.grant(VM, f"projects/{P}/roles/stopper", path)
    assert vm.compute_call("POST", f"{path}/stop")["status"] == "PENDING"
    assert [vm.compute_call("GET", path)["status"] for _ in range(2)] == ["STOPPING", "TERMINATED"]
    assert coordinator.status == "TERMINATED"
    with pytest.raises(ApiError, match="compute.instances.stop"):  # that instance only
        gcp.add_instance(ZONE, "other")
        vm.compute_call("POST", f"projects/{P}/zones/{ZONE}/instances/other/stop")


def test_a_cloud_run_job_runs_for_who_may_run_that_job(gcp) -> None:
    job = gcp.add_job("us-central1", "exp-control")
    ran: list[str] = []
    gcp.job_runner = ran.append
    url = f"{gcp.run_api}/{job}:run"
    with pytest.raises(ApiError) as e:
        client(gcp, "vm-token").request("POST", url, body={})
    assert e.value.code == 403 and "run.jobs.run" in e.value.message
    gcp.policy.grant(VM, "roles/run.invoker", job)
    answer = client(gcp, "vm-token").request("POST", url, body={})
    assert answer["done"] is False and answer["name"].startswith(f"projects/{P}/locations/us-central1/operations/")
    gcp.stop()  # joins the runner threads
    assert ran == [job] and len(gcp.jobs[job]) == 1


def test_tick_finishes_every_operation(gcp) -> None:
    client(gcp, gcp.token).compute_call("POST", f"{GROUP}/resize", query={"size": 3})
    gcp.tick()
    assert gcp.group("exp-group").target_size == 3
