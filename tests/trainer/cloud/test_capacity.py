"""The on-demand fallback check: the pure policy, and runs against the fake Compute API, as the
control job's service account with exactly what the synthesized stack grants it."""
from __future__ import annotations

import json
from typing import Iterator

import pytest

from drill.fake_gcp import FakeGcp
from drill.iam import Policy
from trainer.cloud import capacity as cap
from trainer.cloud import stop_marker
from trainer.cloud.gce import Client

PROJECT, ZONES = "my-project-123456", ("us-central1-a", "us-central1-b")
MIN = 60.0


def settings(**changes) -> cap.Settings:
    base = dict(project=PROJECT, region="us-central1", location="regions/us-central1", spot_group="exp-group",
                od_group="exp-od-group", machine_type="g2-standard-8", zones=ZONES, bucket="spottrain-test",
                state_object="runs/exp/control/capacity.json", stop_markers=("runs/exp/stop/finished-steps-10",),
                paused=False, fallback_after_s=30 * 60, min_on_demand_s=20 * 60, back_to_spot=0.7)
    return cap.Settings(**{**base, **changes})


def obs(spot=(1, 0, 0), od=(0, 0, 0), stopped=False, advice=None) -> cap.Observation:
    return cap.Observation(*spot, *od, stopped=stopped, spot_obtainability=advice)


S = settings()


def test_spot_waits_then_falls_back_on_demand_after_the_configured_time() -> None:
    d = cap.decide(cap.State(), obs(), 0.0, S)
    assert (d.state.mode, d.resize, d.state.waiting_since) == ("spot", (), 0.0)
    d = cap.decide(d.state, obs(), 29 * MIN, S)
    assert d.state.mode == "spot" and d.resize == ()
    d = cap.decide(d.state, obs(), 30 * MIN, S)
    assert d.state.mode == "on-demand"
    assert d.resize == (("spot", 0), ("od", 1))  # the Spot ask is withdrawn before on demand starts


def test_a_running_spot_vm_resets_the_wait() -> None:
    d = cap.decide(cap.State(), obs(), 0.0, S)
    d = cap.decide(d.state, obs(spot=(1, 1, 1)), 20 * MIN, S)
    assert d.state.waiting_since is None
    d = cap.decide(d.state, obs(), 40 * MIN, S)  # preempted again at 40: the clock starts over
    assert d.state.mode == "spot" and d.state.waiting_since == 40 * MIN


def test_back_to_spot_only_after_the_dwell_with_good_advice_and_through_a_save() -> None:
    state = cap.State("on-demand", since=0.0)
    d = cap.decide(state, obs(spot=(0, 0, 0), od=(1, 1, 1)), 10 * MIN, S)
    assert d.state.mode == "on-demand" and not d.needs_advice  # within min_on_demand: no question
    d = cap.decide(state, obs(spot=(0, 0, 0), od=(1, 1, 1)), 25 * MIN, S)
    assert d.needs_advice and d.state == state
    d = cap.decide(state, obs(spot=(0, 0, 0), od=(1, 1, 1), advice=0.3), 25 * MIN, S)
    assert d.state.mode == "on-demand" and d.resize == ()
    d = cap.decide(state, obs(spot=(0, 0, 0), od=(1, 1, 1), advice=0.8), 25 * MIN, S)
    assert d.state.mode == "to-spot" and d.resize == (("od", 0),)
    # The on-demand VM is still saving: Spot must not start yet (two writers).
    d2 = cap.decide(d.state, obs(spot=(0, 0, 0), od=(0, 0, 1)), 26 * MIN, S)
    assert d2.state.mode == "to-spot" and d2.resize == ()
    d3 = cap.decide(d2.state, obs(spot=(0, 0, 0), od=(0, 0, 0)), 27 * MIN, S)
    assert d3.state.mode == "spot" and d3.resize == (("spot", 1),) and d3.state.waiting_since == 27 * MIN


def test_never_both_groups_up_at_once_in_any_transition() -> None:
    for state in (cap.State(), cap.State("on-demand", 0.0), cap.State("to-spot", 0.0), cap.State("paused")):
        for spot in ((0, 0, 0), (1, 0, 0), (1, 1, 1)):
            for od in ((0, 0, 0), (1, 0, 0), (1, 1, 1), (0, 0, 1)):
                for advice in (None, 0.1, 0.9):
                    d = cap.decide(state, obs(spot, od, advice=advice), 10_000.0, S)
                    sizes = {"spot": spot[0], "od": od[0], **dict(d.resize)}
                    assert sizes["spot"] + sizes["od"] <= 1, (state, spot, od, d)


def test_a_stop_marker_or_a_pause_takes_both_groups_to_zero() -> None:
    d = cap.decide(cap.State("on-demand", 0.0), obs(spot=(0, 0, 0), od=(1, 1, 1), stopped=True), 5.0, S)
    assert d.state.mode == "stopped" and d.resize == (("od", 0),)
    d = cap.decide(cap.State(), obs(spot=(1, 1, 1)), 5.0, settings(paused=True))
    assert d.state.mode == "paused" and d.resize == (("spot", 0),)
    d = cap.decide(d.state, obs(spot=(0, 0, 0)), 6.0, S)  # workers = 1 again
    assert d.state.mode == "spot" and d.resize == (("spot", 1),)


def test_state_survives_a_round_trip_and_garbage_starts_over() -> None:
    state = cap.decide(cap.State(), obs(), 0.0, S).state
    assert cap.State.from_json(state.to_json()) == state
    assert cap.State.from_json('{"mode": "sideways"}') == cap.State()
    assert cap.State.from_json(None) == cap.State()


FALLBACK = {"gcp": {"zones": list(ZONES)}, "group": {"placement": "regional"},
            "capacity": {"on_demand_fallback_minutes": 30}}


@pytest.fixture
def fake(gcs_emulator, stack_json, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeGcp, list[float]]]:
    clock = [0.0]
    with FakeGcp(PROJECT, clock=lambda: clock[0], policy=Policy.from_stack(stack_json("exp", FALLBACK))) as gcp:
        gcp.add_identity("control-token", f"serviceAccount:exp-control@{PROJECT}.iam.gserviceaccount.com")
        gcp.add_region("us-central1", ZONES, {}, ("g2-standard-8",))
        gcp.add_group("exp-group", region="us-central1", zones=ZONES, provisioning="SPOT", auto=True)
        gcp.add_group("exp-od-group", region="us-central1", zones=ZONES, target_size=0,
                      provisioning="STANDARD", auto=True)
        monkeypatch.setenv("SPOTTRAIN_COMPUTE_API", gcp.compute_api)
        monkeypatch.setenv("SPOTTRAIN_SECRETMANAGER_API", gcp.secretmanager_api)
        gcp.add_secret("exp-checkpoint-key")
        gcp.add_secret_version(KEY_SECRET, KEY)  # as the first VM's boot added it
        yield gcp, clock


KEY = b"k" * 32
KEY_SECRET = f"projects/{PROJECT}/secrets/exp-checkpoint-key"


def controller(log=lambda line: None):
    """The control job of the fallback experiment, as its account (the settings the stack gives it)."""
    from trainer.cloud.control import Control, Settings

    s = settings()
    return Control(Settings(project=PROJECT, region="us-central1", location="regions/us-central1",
                            groups=("exp-group", "exp-od-group"), bucket="spottrain-test", prefix="runs/exp",
                            stop_markers=s.stop_markers, capacity=vars(s), poll_s=0.0,
                            checkpoint_key_secret=KEY_SECRET),
                   Client(token=lambda: ("control-token", 3600.0), sleep=lambda t: None), log=log)


def client(gcp: FakeGcp) -> Client:
    return Client(token=lambda: ("control-token", 3600.0))


def test_one_check_against_the_fake_api_falls_back_and_returns(fake, gcs_emulator) -> None:
    gcp, clock = fake
    spot_available = [False]
    gcp.capacity = lambda zone, model: model != "SPOT" or spot_available[0]
    check = cap.Check(settings(), client(gcp), clock=lambda: clock[0], stopped=False)
    for minute in range(0, 35, 5):
        clock[0] = minute * MIN
        gcp.tick()  # five minutes passed: the last check's resizes are done
        check.run()
    gcp.tick()
    assert gcp.group("exp-group").target_size == 0 and gcp.group("exp-od-group").target_size == 1
    assert len(gcp.group("exp-od-group").running()) == 1
    stored = json.loads(gcs_emulator.client.bucket("spottrain-test").blob("runs/exp/control/capacity.json")
                        .download_as_bytes())
    assert stored["mode"] == "on-demand"
    spot_available[0] = True
    for minute in range(35, 70, 5):
        clock[0] = minute * MIN
        gcp.tick()
        check.run()
    gcp.tick()
    assert gcp.group("exp-od-group").target_size == 0 and gcp.group("exp-group").target_size == 1
    assert len(gcp.group("exp-group").running()) == 1
    assert gcp.calls_to("POST", "/advice/capacity"), "the way back asks the capacity advice"
    # A finished job (a marker the control job verified): the check takes everything to zero.
    check = cap.Check(settings(), client(gcp), clock=lambda: clock[0], stopped=True)
    clock[0] = 75 * MIN
    assert check.run().state.mode == "stopped"
    gcp.tick()
    assert gcp.group("exp-group").target_size == 0
    assert gcp.refusals == [] and check.failures == []
    # It never waited on an operation (which its grants could not read).
    assert gcp.calls_to("GET", "/operations/") == [] and gcp.calls_to("POST", "/operations/") == []


def test_a_failed_shrink_is_reported_and_nothing_grows_after_it(fake, gcs_emulator) -> None:
    gcp, clock = fake
    gcp.capacity = lambda zone, model: model != "SPOT"
    check = cap.Check(settings(), client(gcp), clock=lambda: clock[0], stopped=False)
    check.run()
    gcp.deny("POST", r"/instanceGroupManagers/exp-group/resize$")
    clock[0] = 31 * MIN
    gcp.tick()
    decision = check.run()
    assert decision.resize == (("spot", 0), ("od", 1))
    assert [f.split(":")[0] for f in check.failures] == ["exp-group", "exp-od-group"]
    assert "a shrink before it failed" in check.failures[1]
    gcp.tick()
    assert gcp.group("exp-group").target_size == 1 and gcp.group("exp-od-group").target_size == 0
    assert gcp.calls_to("POST", "/exp-od-group/resize") == []  # never two VMs by mistake


def test_a_stopped_fallback_job_has_both_groups_at_zero_confirmed_by_the_control_job(fake, gcs_emulator) -> None:
    """The control job runs the check; a stop marker the run signed (by the VM on demand now,
    with no checkpoint anywhere yet) takes both groups to zero, each confirmed on the group
    itself, and the outcome tells the VM that asked."""
    gcp, clock = fake
    gcp.set_target("exp-od-group", 1)  # on demand at the moment
    gcp.tick()
    (vm,) = gcp.group("exp-od-group").instances.values()
    marker = "runs/exp/stop/finished-steps-10"
    gcs_emulator.client.bucket("spottrain-test").blob(marker).upload_from_string(stop_marker.sign(KEY, {
        "reason": "finished", "step": None, "instance": vm.name, "instance_id": vm.id, "name": marker,
        "run": "gs://spottrain-test/runs/exp"}))
    control = controller()
    assert control.run() == 0, control.failures
    assert gcp.group("exp-group").target_size == 0 and gcp.group("exp-od-group").target_size == 0
    outcome = json.loads(gcs_emulator.client.bucket("spottrain-test").blob("runs/exp/control/outcome.json")
                         .download_as_bytes())
    assert outcome["ok"] and outcome["groups"] == {"exp-group": 0, "exp-od-group": 0}
    assert gcp.refusals == []


def test_a_planted_marker_leaves_the_fallback_running(fake, gcs_emulator) -> None:
    """A marker the run did not sign (`{}`, planted by a bucket writer): the check goes on as if
    there were none (the on-demand VM keeps its group and its disk), and the job fails with the
    refusal, for an alert."""
    gcp, clock = fake
    gcp.set_target("exp-od-group", 1)
    gcp.tick()
    gcs_emulator.client.bucket("spottrain-test").blob("runs/exp/stop/finished-steps-10").upload_from_string(b"{}")
    lines: list[str] = []
    control = controller(log=lines.append)
    assert control.run() == 1
    assert gcp.group("exp-od-group").target_size == 1
    assert list(control.refused) == ["runs/exp/stop/finished-steps-10"]
    assert [json.loads(x)["event"] for x in lines if '"stop_marker_refused"' in x] == ["stop_marker_refused"]
    assert gcp.refusals == []


def test_the_control_job_refuses_bad_settings_with_status_2(monkeypatch, capsys) -> None:
    from trainer.cloud import control

    monkeypatch.setenv(control.ENV, "{not json")
    assert control.main() == control.EXIT_BAD
    assert control.ENV in capsys.readouterr().err
    name = control.successor_name("a" * 40 + "-group", "b" * 40)
    assert len(name) <= 63 and name == control.successor_name("a" * 40 + "-group", "b" * 40)


def test_a_stopped_job_shrinks_every_group_even_when_one_shrink_fails(fake, gcs_emulator) -> None:
    gcp, clock = fake
    gcp.set_target("exp-od-group", 1)
    gcp.deny("POST", r"/instanceGroupManagers/exp-group/resize$")
    check = cap.Check(settings(), client(gcp), clock=lambda: clock[0], stopped=True)
    assert check.run().state.mode == "stopped"
    gcp.tick()
    assert gcp.group("exp-od-group").target_size == 0 and gcp.group("exp-group").target_size == 1
    assert [f.split(":")[0] for f in check.failures] == ["exp-group"]
