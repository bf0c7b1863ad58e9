"""The on-demand fallback under a Spot stockout: timeline and cost (`python -m bench capacity_bench`).

A simulated clock drives the real pieces: the fake Compute API (`drill/fake_gcp.py`) refuses Spot
for T minutes (and preempts the running Spot VM when the stockout begins), and every
`fallback_check_minutes` the capacity check (`trainer.cloud.capacity.Check`, the code the control job
runs) reads the groups, asks the capacity advice, resizes, and keeps its state in a real
gcp-storage-emulator bucket. A resize is an operation the fake finishes when the clock moves on
(the next simulated minute), as Compute schedules it: a new VM appears a minute after its check. The job is `HOURS` of training; a new VM trains after
`RESTART_MIN` minutes (boot, driver, restore); every stop is a save (nothing lost). Prices: the
a3-highgpu-8g fixture (8 x H100) from the catalog. Compared: Spot alone (wait the stockout out),
Spot with the fallback after 15, 30 and 60 minutes, and on demand alone.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from drill.fake_gcp import FakeGcp
from drill.gcs_emulator import StorageEmulator

HOURS = 8.0  # training the job needs
RESTART_MIN = 10  # minutes from a new VM to training again
STOCKOUT_AT_MIN = 60  # the stockout begins one hour into the job
STOCKOUTS_MIN = (30, 120, 360)
CHECK_MIN = 5
FALLBACKS = (None, 15, 30, 60)  # None: Spot alone
PROJECT, REGION, ZONES = "my-project-123456", "us-central1", ("us-central1-a", "us-central1-b")
FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "stacks" / "fixtures" / "a3-regional.toml"


@dataclass
class Run:
    policy: str
    stockout_min: int
    finished_min: int = 0
    spot_min: int = 0
    od_min: int = 0
    idle_min: int = 0
    switches: int = 0
    cost: float = 0.0
    timeline: list[tuple[int, str]] = field(default_factory=list)


def simulate(stockout_min: int, fallback_min: int | None, prices: tuple[float, float], bucket_host: str,
             bucket: str, on_demand_only: bool = False) -> Run:
    from trainer.cloud import capacity as cap
    from trainer.cloud.gce import Client

    spot_price, od_price = prices
    policy = "on demand alone" if on_demand_only else (
        "Spot alone" if fallback_min is None else f"Spot, fallback after {fallback_min} min")
    run = Run(policy, stockout_min)
    now = [0.0]
    stockout = (STOCKOUT_AT_MIN * 60.0, (STOCKOUT_AT_MIN + stockout_min) * 60.0)
    with FakeGcp(PROJECT, clock=lambda: now[0]) as gcp:
        gcp.capacity = lambda zone, model: model != "SPOT" or not stockout[0] <= now[0] < stockout[1]
        gcp.add_region(REGION, ZONES, {}, ("a3-highgpu-8g",))
        gcp.add_group("job-group", region=REGION, zones=ZONES, provisioning="SPOT", auto=True,
                      target_size=0 if on_demand_only else 1)
        gcp.add_group("job-od-group", region=REGION, zones=ZONES, provisioning="STANDARD", auto=True,
                      target_size=1 if on_demand_only else 0)
        settings = cap.Settings(
            project=PROJECT, region=REGION, location=f"regions/{REGION}", spot_group="job-group",
            od_group="job-od-group", machine_type="a3-highgpu-8g", zones=ZONES, bucket=bucket,
            state_object=f"runs/sim-{policy.replace(' ', '-')}-{stockout_min}/control/capacity.json",
            stop_markers=(), paused=False, fallback_after_s=(fallback_min or 10**9) * 60,
            min_on_demand_s=30 * 60, back_to_spot=0.7)
        client = Client(token=lambda: (gcp.token, 3600.0), compute=gcp.compute_api, storage=bucket_host)
        check = cap.Check(settings, client, clock=lambda: now[0], log=lambda line: None, stopped=False)
        trained, last, minute = 0.0, "", 0
        while trained < HOURS * 60:
            now[0] = minute * 60.0
            gcp.tick()
            if fallback_min is not None and minute % CHECK_MIN == 0:
                d = check.run()
                if d.resize:
                    run.timeline.append((minute, f"check: {d.note}"))
            spot, od = gcp.group("job-group").running(), gcp.group("job-od-group").running()
            vm = spot[0] if spot else od[0] if od else None
            state = "Spot VM" if spot else "on-demand VM" if od else "no VM"
            if state != last:
                run.timeline.append((minute, state + ("" if vm is None else f" in {vm.zone}")))
                if last and state != "no VM":
                    run.switches += 1
                last = state
            if vm is None:
                run.idle_min += 1
            else:
                run.spot_min += bool(spot)
                run.od_min += bool(od)
                if now[0] - vm.created >= RESTART_MIN * 60:
                    trained += 1
            minute += 1
        run.finished_min = minute
        run.timeline.append((minute, "finished: the control job scales the group to zero"))
    run.cost = run.spot_min / 60 * spot_price + run.od_min / 60 * od_price
    return run


def _hm(minutes: int) -> str:
    return f"{minutes // 60}h{minutes % 60:02d}"


def main() -> None:
    from stacks import pricing
    from stacks.load import load_file

    exp = load_file(FIXTURE).spec
    q = pricing.quote(exp)
    prices = (q.spot, q.on_demand)
    print(f"### capacity_bench: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"simulated clock, job of {HOURS:g} h of training, a3-highgpu-8g Spot ${q.spot:.2f}/h, on demand "
          f"${q.on_demand:.2f}/h (catalog {pricing.CATALOG_DATE}); restart {RESTART_MIN} min; stockout from "
          f"minute {STOCKOUT_AT_MIN}; check every {CHECK_MIN} min\n")
    with StorageEmulator("capacity-bench", quiet=True) as emu:
        runs = [simulate(t, f, prices, emu.host, "capacity-bench") for t in STOCKOUTS_MIN for f in FALLBACKS]
        runs += [simulate(0, None, prices, emu.host, "capacity-bench", on_demand_only=True)]
    print("| stockout | policy | done after | Spot VM | on-demand VM | no VM | VMs after the first | cost | × Spot alone |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    base = {r.stockout_min: r for r in runs if r.policy == "Spot alone"}
    for r in runs:
        ref = base.get(r.stockout_min)
        ratio = f"{r.cost / ref.cost:.2f}" if ref and r is not ref else "1.00" if ref else "-"
        stock = "-" if r.policy == "on demand alone" else _hm(r.stockout_min)
        print(f"| {stock} | {r.policy} | {_hm(r.finished_min)} | {_hm(r.spot_min)} | {_hm(r.od_min)} | "
              f"{_hm(r.idle_min)} | {r.switches} | ${r.cost:,.2f} | {ratio} |")
    pick = next(r for r in runs if r.stockout_min == 120 and r.policy == "Spot, fallback after 30 min")
    print(f"\nTimeline of the {_hm(pick.stockout_min)} stockout, {pick.policy}:\n")
    print("| minute | event |")
    print("|---:|---|")
    for minute, what in pick.timeline:
        print(f"| {minute} | {what} |")


if __name__ == "__main__":
    main()
