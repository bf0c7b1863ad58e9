"""The IAM model the fakes enforce (`drill.iam`): conditions as Google evaluates them, roles, and
bindings read from a synthesized stack's JSON."""
from __future__ import annotations

import json

import pytest

from drill.iam import Condition, Policy, PolicyError, Resource, accounts

P = "my-project-123456"
SA = f"serviceAccount:exp-control@{P}.iam.gserviceaccount.com"
GROUP = Resource("compute.googleapis.com", "compute.googleapis.com/InstanceGroupManager",
                 f"projects/{P}/zones/us-central1-a/instanceGroupManagers/exp-group", (f"projects/{P}",))
VM = Resource("compute.googleapis.com", "compute.googleapis.com/Instance",
              f"projects/{P}/zones/us-central1-a/instances/exp-coordinator", (f"projects/{P}",))
OBJECT = Resource("storage.googleapis.com", "storage.googleapis.com/Object",
                  "projects/_/buckets/b/objects/runs/exp/stop/finished.json", (f"projects/{P}", "projects/_/buckets/b"))
BUCKET = Resource("storage.googleapis.com", "storage.googleapis.com/Bucket", "projects/_/buckets/b", (f"projects/{P}",))


def test_a_name_condition_never_matches_a_type_iam_does_not_describe():
    # iam/docs/conditions-resource-attributes lists no instance group managers: the exact name
    # grants nothing, while the same condition on an instance (listed) does.
    assert not Condition(f'resource.name == "{GROUP.name}"').grants(GROUP)
    assert Condition(f'resource.name == "{VM.name}"').grants(VM)
    assert not Condition('resource.name != "x"').grants(GROUP)  # unknown, not true
    assert not Condition('resource.type == "compute.googleapis.com/InstanceGroupManager"').grants(GROUP)


def test_unknown_parts_never_grant_but_a_true_part_of_an_or_still_does():
    either = Condition(f'resource.name == "{GROUP.name}" || resource.name.startsWith("projects/_/buckets/b/")')
    assert either.grants(OBJECT) and not either.grants(GROUP)
    both = Condition('resource.service == "compute.googleapis.com" && resource.name.endsWith("exp-group")')
    assert not both.grants(GROUP)
    guarded = Condition('(resource.type != "storage.googleapis.com/Bucket" && '
                        'resource.type != "storage.googleapis.com/Object") || '
                        'resource.name.startsWith("projects/_/buckets/other")')
    assert guarded.grants(VM) and not guarded.grants(OBJECT) and not guarded.grants(BUCKET)
    assert not Condition('!(resource.name == "x")').grants(GROUP)


@pytest.mark.parametrize("expression", ['request.time < timestamp("2030-01-01T00:00:00Z")',
                                        'resource.name.matches("x")', 'resource.name == 3'])
def test_an_expression_outside_the_subset_is_an_error_not_a_guess(expression):
    with pytest.raises(PolicyError):
        Condition(expression)


def test_roles_project_bindings_and_resource_bindings():
    policy = Policy(custom_roles={f"projects/{P}/roles/groups": frozenset({"compute.instanceGroupManagers.update"}),
                                  f"projects/{P}/roles/vm": frozenset({"compute.instances.stop"})})
    policy.grant(SA, f"projects/{P}/roles/groups", f"projects/{P}")
    policy.grant(SA, f"projects/{P}/roles/vm", VM.name)  # the instance's own allow policy
    assert policy.allows(SA, "compute.instanceGroupManagers.update", GROUP)
    assert not policy.allows(SA, "compute.zoneOperations.get", GROUP)
    assert policy.allows(SA, "compute.instances.stop", VM)
    other = Resource("compute.googleapis.com", "compute.googleapis.com/Instance",
                     f"projects/{P}/zones/us-central1-a/instances/someone-else", (f"projects/{P}",))
    assert not policy.allows(SA, "compute.instances.stop", other)
    assert not policy.allows("serviceAccount:x@y", "compute.instances.stop", VM)
    with pytest.raises(PolicyError, match="PREDEFINED"):
        policy.grant(SA, "roles/compute.instanceAdmin.v1", f"projects/{P}")


def test_a_policy_read_from_stack_json_resolves_references():
    stack = {"resource": {
        "google_service_account": {"sa": {"account_id": "exp-control", "project": P}},
        "google_storage_bucket": {"b": {"name": "b", "project": P}},
        "google_project_iam_custom_role": {"r": {"project": P, "role_id": "spottrain_exp_control",
                                                 "permissions": ["compute.instanceGroupManagers.get"]}},
        "google_project_iam_member": {"m": {"project": P, "role": "${google_project_iam_custom_role.r.name}",
                                            "member": "serviceAccount:${google_service_account.sa.email}"}},
        "google_storage_bucket_iam_member": {"o": {
            "bucket": "${google_storage_bucket.b.name}", "role": "roles/storage.objectViewer",
            "member": "serviceAccount:${google_service_account.sa.email}",
            "condition": {"title": "t", "expression":
                          'resource.name.startsWith("projects/_/buckets/${google_storage_bucket.b.name}/objects/runs/exp/stop/")'}}},
    }}
    policy = Policy.from_stack(stack)
    assert accounts(stack) == {"exp-control": f"exp-control@{P}.iam.gserviceaccount.com"}
    assert policy.allows(SA, "compute.instanceGroupManagers.get", GROUP)
    assert policy.allows(SA, "storage.objects.get", OBJECT)
    assert not policy.allows(SA, "storage.objects.list", BUCKET)  # listing is on the bucket
    stack["resource"]["google_project_iam_member"]["m"]["role"] = "roles/editor"
    with pytest.raises(PolicyError, match="roles/editor"):
        Policy.from_stack(stack)


def test_what_cloud_storage_checks_for_each_request():
    from drill.iam import storage_checks

    exists = {("b", "runs/exp/control/outcome.json")}

    def checks(method: str, path: str, body: bytes = b"") -> list[tuple[str, str]]:
        return [(p, r.name) for p, r in storage_checks(method, path, body, lambda b, n: (b, n) in exists,
                                                        lambda b: P)]

    o = "projects/_/buckets/b/objects/runs/exp/control/outcome.json"
    assert checks("GET", "/storage/v1/b/b/o/runs%2Fexp%2Fcontrol%2Foutcome.json?alt=media") == [("storage.objects.get", o)]
    assert checks("GET", "/storage/v1/b/b/o?prefix=runs/exp/") == [("storage.objects.list", "projects/_/buckets/b")]
    # An upload that replaces an object needs delete as well; a create-only one does not.
    assert checks("POST", "/upload/storage/v1/b/b/o?uploadType=media&name=runs/exp/control/outcome.json") == [
        ("storage.objects.create", o), ("storage.objects.delete", o)]
    assert checks("POST", "/upload/storage/v1/b/b/o?uploadType=media&name=runs/exp/control/outcome.json"
                          "&ifGenerationMatch=0") == [("storage.objects.create", o)]
    assert checks("DELETE", "/storage/v1/b/b/o/runs%2Fexp%2Fcontrol%2Foutcome.json") == [("storage.objects.delete", o)]
    # A compose creates its object and reads every source (a composite upload's parts).
    parts = json.dumps({"sourceObjects": [{"name": "runs/exp/.tmp-parts/s.bin.1/00", "generation": 5},
                                          {"name": "runs/exp/.tmp-parts/s.bin.1/01"}]}).encode()
    part = "projects/_/buckets/b/objects/runs/exp/.tmp-parts/s.bin.1/"
    assert checks("POST", "/storage/v1/b/b/o/runs%2Fexp%2Fcontrol%2Foutcome.json/compose?ifGenerationMatch=0",
                  parts) == [("storage.objects.create", o), ("storage.objects.get", part + "00"),
                             ("storage.objects.get", part + "01")]
    assert ("storage.objects.delete", o) in checks(
        "POST", "/storage/v1/b/b/o/runs%2Fexp%2Fcontrol%2Foutcome.json/compose", parts)
    with pytest.raises(PolicyError):
        checks("POST", "/storage/v1/b/b/o/x/rewriteTo/b/b/o/y")
