"""drill/fake_observability.py refuses what Cloud Logging, Cloud Monitoring and the Billing Catalog
refuse: it is never kinder than the APIs it stands for."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator

import pytest

from drill.fake_observability import FakeObservability, Filter, FilterError

P, TOKEN = "proj-123456", "tok"
RES = {"type": "gce_instance", "labels": {"instance_id": "1", "zone": "us-central1-a"}}
NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)


@pytest.fixture
def fake() -> Iterator[FakeObservability]:
    clock = {"t": NOW.timestamp()}
    with FakeObservability(P, token=TOKEN, clock=lambda: clock["t"]) as f:
        f.clock_box = clock  # type: ignore[attr-defined]
        yield f


def call(fake: FakeObservability, method: str, path: str, body: Any = None, token: str = TOKEN) -> tuple[int, Any]:
    req = urllib.request.Request(fake.url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _entry(i: int, **kw: Any) -> dict[str, Any]:
    t = (NOW - timedelta(minutes=10) + timedelta(seconds=i)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"logName": f"projects/{P}/logs/spottrain", "resource": RES, "timestamp": t,
            "jsonPayload": {"n": i}, "labels": {"spottrain-experiment": "ex"}, **kw}


def test_entries_write_refuses_what_logging_refuses(fake) -> None:
    bad = [
        {**_entry(0), "logName": "projects/other-project/logs/x"},          # another project: 403
        {**_entry(0), "logName": f"projects/{P}/logs/a b"},                 # not a log id
        {**_entry(0), "resource": {"type": "no_such_type", "labels": {}}},
        {**_entry(0), "resource": {"type": "gce_instance", "labels": {"zone": "z"}}},  # no instance_id
        {**_entry(0), "textPayload": "and a json payload too"},
        {**_entry(0), "severity": "LOUD"},
        {**_entry(0), "timestamp": "yesterday"},
        {**_entry(0), "jsonPayload": {"x": "y" * 300_000}},                 # over 256 KB
    ]
    codes = [call(fake, "POST", "/v2/entries:write", {"entries": [e]})[0] for e in bad]
    assert codes == [403, 400, 400, 400, 400, 400, 400, 400]
    status, err = call(fake, "POST", "/v2/entries:write", {"entries": []})
    assert status == 400 and err["error"]["status"] == "INVALID_ARGUMENT"
    assert call(fake, "POST", "/v2/entries:write", {"entries": [_entry(0)]}, token="wrong")[0] == 401
    assert fake.entries == []


def test_one_bad_entry_fails_the_batch_unless_partial_success(fake) -> None:
    batch = [_entry(1), {**_entry(2), "severity": "LOUD"}]
    assert call(fake, "POST", "/v2/entries:write", {"entries": batch})[0] == 400
    assert fake.entries == []
    assert call(fake, "POST", "/v2/entries:write", {"entries": batch, "partialSuccess": True})[0] == 400
    assert [e["jsonPayload"]["n"] for e in fake.entries] == [1]


def test_defaults_duplicates_and_retention(fake) -> None:
    body = {"logName": f"projects/{P}/logs/spottrain", "resource": RES, "labels": {"k": "v"},
            "entries": [{"jsonPayload": {"n": 1}, "insertId": "a", "timestamp": "2026-03-01T11:00:00Z"},
                        {"jsonPayload": {"n": 1}, "insertId": "a", "timestamp": "2026-03-01T11:00:00Z"},
                        {"jsonPayload": {"n": 2}, "timestamp": "2025-12-01T00:00:00Z"}]}  # past retention
    assert call(fake, "POST", "/v2/entries:write", body)[0] == 200
    assert len(fake.entries) == 2  # the duplicate insertId is kept once
    status, page = call(fake, "POST", "/v2/entries:list", {"resourceNames": [f"projects/{P}"]})
    assert status == 200 and [e["jsonPayload"]["n"] for e in page["entries"]] == [1]  # the old one is not listed
    assert page["entries"][0]["labels"] == {"k": "v"} and page["entries"][0]["resource"]["labels"]["project_id"] == P


def test_entries_list_filters_orders_and_pages(fake) -> None:
    assert call(fake, "POST", "/v2/entries:write", {"entries": [_entry(i) for i in range(7)]})[0] == 200
    body = {"resourceNames": [f"projects/{P}"], "filter": 'labels."spottrain-experiment"="ex" AND jsonPayload.n>=2',
            "orderBy": "timestamp desc", "pageSize": 2}
    got, token = [], None
    while True:
        status, page = call(fake, "POST", "/v2/entries:list", {**body, **({"pageToken": token} if token else {})})
        assert status == 200
        got += [e["jsonPayload"]["n"] for e in page.get("entries", [])]
        token = page.get("nextPageToken")
        if not token:
            break
    assert got == [6, 5, 4, 3, 2]
    # A page token belongs to its query; bad sizes, orders, filters and resources are refused.
    _, first = call(fake, "POST", "/v2/entries:list", body)
    assert call(fake, "POST", "/v2/entries:list", {**body, "filter": "", "pageToken": first["nextPageToken"]})[0] == 400
    for change in ({"pageSize": 1001}, {"orderBy": "severity"}, {"filter": 'nosuchfield="x"'},
                   {"filter": 'jsonPayload.n =~ "("'}, {"resourceNames": []}):  # an invalid RE2 pattern
        assert call(fake, "POST", "/v2/entries:list", {**body, **change})[0] == 400, change
    assert call(fake, "POST", "/v2/entries:list", {**body, "resourceNames": ["projects/other"]})[0] == 403
    # A regular expression matches anywhere unless anchored, as Logging's =~ does.
    status, found = call(fake, "POST", "/v2/entries:list", {**body, "pageSize": 10, "filter": 'jsonPayload.n =~ "^[2-4]$"'})
    assert status == 200 and sorted(e["jsonPayload"]["n"] for e in found.get("entries", [])) == [2, 3, 4]


def test_the_filter_language_subset() -> None:
    e = {"logName": "projects/p/logs/spottrain", "severity": "ERROR", "timestamp": "2026-03-01T11:00:00.5Z",
         "labels": {"spottrain-experiment": "ex"}, "jsonPayload": {"event": "failed", "fields": {"reason": "bad_input"}}}
    assert Filter('labels."spottrain-experiment"="ex" jsonPayload.event="failed"').matches(e)
    assert Filter('severity>=WARNING AND timestamp>"2026-03-01T10:00:00Z"').matches(e)
    assert Filter('(jsonPayload.event="x" OR jsonPayload.fields.reason:"BAD") -jsonPayload.event="step"').matches(e)
    assert not Filter('jsonPayload.missing="x"').matches(e) and Filter('NOT jsonPayload.missing="x"').matches(e)
    for bad in ('foo="x"', '(jsonPayload.event="x"', 'jsonPayload.event=', 'severity>LOUD'):
        with pytest.raises(FilterError):
            Filter(bad).matches(e)


def _series(t: datetime, value: Any = {"doubleValue": 0.9}, **kw: Any) -> dict[str, Any]:
    return {"metric": {"type": "custom.googleapis.com/spottrain/goodput", "labels": {"experiment": "ex"}},
            "resource": {"type": "global", "labels": {"project_id": P}}, "metricKind": "GAUGE",
            "points": [{"interval": {"endTime": t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}, "value": value}], **kw}


def test_time_series_create_keeps_monitorings_rules(fake) -> None:
    path = f"/v3/projects/{P}/timeSeries"
    t = NOW - timedelta(seconds=30)
    assert call(fake, "POST", path, {"timeSeries": [_series(t)]}) == (200, {})
    status, err = call(fake, "POST", path, {"timeSeries": [_series(t + timedelta(seconds=2))]})
    assert status == 400 and "more frequently" in err["error"]["message"]  # one point each 5 s
    assert "in order" in call(fake, "POST", path, {"timeSeries": [_series(t - timedelta(seconds=10))]})[1]["error"]["message"]
    assert call(fake, "POST", path, {"timeSeries": [_series(t + timedelta(seconds=5))]})[0] == 200
    assert "must be DOUBLE" in call(fake, "POST", path, {"timeSeries": [
        _series(t + timedelta(seconds=10), {"int64Value": "3"})]})[1]["error"]["message"]
    two_points = _series(t + timedelta(seconds=20))
    two_points["points"] *= 2
    for bad in (two_points, _series(NOW - timedelta(hours=26)), _series(NOW + timedelta(minutes=6)),
                {**_series(t + timedelta(seconds=20)), "metric": {"type": "compute.googleapis.com/x"}},
                {**_series(t + timedelta(seconds=20)), "resource": {"type": "global", "labels": {}}}):
        assert call(fake, "POST", path, {"timeSeries": [bad]})[0] == 400, bad
    assert call(fake, "POST", path, {"timeSeries": [_series(t + timedelta(seconds=30))] * 201})[0] == 400
    assert call(fake, "POST", "/v3/projects/other/timeSeries", {"timeSeries": [_series(t)]})[0] == 403
    (points,) = fake.series.values()
    assert [v for _, v in points] == [0.9, 0.9]


def test_the_billing_catalog_pages_its_skus(fake) -> None:
    fake.add_service("6F81-5844-456A", "Compute Engine", [{"skuId": f"S{i}", "description": f"sku {i}"} for i in range(5)])
    got, token = [], ""
    while True:
        status, page = call(fake, "GET", "/v1/services/6F81-5844-456A/skus?currencyCode=USD&pageSize=2"
                                         + (f"&pageToken={token}" if token else ""))
        assert status == 200
        got += [s["skuId"] for s in page["skus"]]
        token = page.get("nextPageToken", "")
        if not token:
            break
    assert got == [f"S{i}" for i in range(5)]
    assert call(fake, "GET", "/v1/services/NOPE/skus")[0] == 404
    assert call(fake, "GET", "/v1/services/6F81-5844-456A/skus?pageSize=5001")[0] == 400
    assert call(fake, "GET", "/v1/services/6F81-5844-456A/skus?pageToken=garbage")[0] == 400
    assert call(fake, "GET", "/v1/services")[1]["services"][0]["displayName"] == "Compute Engine"


def test_writes_need_the_vm_accounts_logging_and_monitoring_permissions() -> None:
    """The VM's account writes its entries and points with the roles the stack grants it
    (roles/logging.logWriter, roles/monitoring.metricWriter); without them Google answers 403."""
    from pathlib import Path

    from drill.iam import Policy, accounts, service_account
    from stacks.stack import synthesized
    from stacks.load import load_file

    ef = load_file(Path(__file__).resolve().parents[2] / "experiments" / "example.toml")
    stack = synthesized(ef.name, ef.spec)
    project = ef.spec.gcp.project
    granted = Policy.from_stack(stack)
    vms = [e for a, e in accounts(stack).items() if "control" not in a]
    assert vms
    entry = {"logName": f"projects/{project}/logs/spottrain", "resource": {"type": "global", "labels": {
        "project_id": project}}, "jsonPayload": {"n": 1}}
    point = {"timeSeries": [{"metric": {"type": "custom.googleapis.com/spottrain/step"},
                             "resource": {"type": "global", "labels": {"project_id": project}},
                             "points": [{"interval": {"endTime": datetime.now(timezone.utc).strftime(
                                 "%Y-%m-%dT%H:%M:%SZ")}, "value": {"doubleValue": 1.0}}]}]}
    for policy, want in ((granted, 200), (Policy(), 403)):
        with FakeObservability(project, policy=policy, principal=service_account(vms[0])) as fake:
            assert fake.handle("POST", "/v2/entries:write", {}, {"entries": [entry]})[0] == want
            assert fake.handle("POST", f"/v3/projects/{project}/timeSeries", {}, point)[0] == want
