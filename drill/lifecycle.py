"""The lifecycle drill: an experiment's synthesized stack through its whole life in a fake project,
then what is left of it and what that costs a month.

1. **Deploy.** The experiment's stack, synthesized for the drill's spec, is applied to a
   `drill.fake_project.FakeProject`: every resource it declares exists there under its Terraform
   address, the bucket is a real one in gcp-storage-emulator with the stack's code objects in it
   (the very archives the drill's VMs fetch: the stack names them by content, so they must match).
2. **Train, preempt, finish, scale to zero.** `drill.drill.run_drill`, unchanged, on that bucket:
   each boot of the VM stand-in is a VM the group creates from its template, with the template's
   disks; each power-off deletes it, and its disks go as Compute Engine takes them (stateful,
   `auto_delete`, or left behind). The finished VM's control job scales the group to zero.
3. **Destroy.** The provider's destroy (`drill.provider`, the model tests/stacks/fake_terraform.py
   shares) of the state the apply wrote.
4. **What is left.** Every resource still in the project, its size, who knows it, and its monthly
   cost. It passes only when what is left is exactly what docs/deploy.md promises: the bucket with
   the run's checkpoints and the checkpoint key (nothing with `force_destroy = true`). A disk that
   a VM left behind, or anything else, is named with its cost and fails the drill.

The apply goes through the fake project's strict stand-ins of what the watch stack touches (an
alert policy on a log-based metric created moments before is refused with Monitoring's 404; a
budget needs billing.budgets.create on its billing account, email channels and the account's
currency). So by default the experiment is applied `watched`: a copy of its file (same name, so
the same resource names) with an email and a webhook channel in `[alerts]` and a `[budget]`
added where it has none; the deployer holds Billing Account Costs Manager on that account (a USD
one). `--as-written` applies the file unchanged.

`python -m drill.lifecycle [--experiment NAME|PATH] [--as-written]` (`make lifecycle`): exit 0 when
it passes, 1 when something else is left or the drill fails, 2 on bad input.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from drill.drill import DrillConfig, DrillFailure, DrillResult, Rendered, check, drill_wheels, render, run_drill, \
    stack_json
from drill.fake_project import FakeProject, Left, ProjectError
from drill.provider import Destroyed

#: What docs/deploy.md says a destroy keeps when the bucket may not be force-destroyed.
KEPT = ("google_storage_bucket", "google_secret_manager_secret")
#: What `watched` adds: channels of two kinds (a budget takes the email one only) and a budget on
#: a billing account whose currency is ACCOUNT_CURRENCY.
WATCH_EMAIL = "oncall@example.com"
WATCH_WEBHOOK = "https://hooks.example.com/spottrain?token=drill"
BILLING_ACCOUNT = "012345-6789AB-CDEF01"
ACCOUNT_CURRENCY = "USD"


def watched(experiment: Path, into: Path) -> Path:
    """A copy of `experiment` in `into` (same file name: same stack and resource names) with an
    email and a webhook channel in `[alerts]` when it names none (and its alerts are on), and a
    `[budget]` on BILLING_ACCOUNT when it has none."""
    from stacks.load import load_file

    spec = load_file(experiment).spec
    text = experiment.read_text()
    if spec.alerts.enabled and not spec.alerts.channels:
        channels = f'email = ["{WATCH_EMAIL}"]\nwebhook_url = "{WATCH_WEBHOOK}"\n'
        if re.search(r"^\[alerts\][ \t]*$", text, re.M):
            text = re.sub(r"^\[alerts\][ \t]*\n", lambda m: m.group(0) + channels, text, count=1, flags=re.M)
        else:
            text += f"\n[alerts]\n{channels}"
    if spec.budget is None:
        text += f'\n[budget]\nbilling_account = "{BILLING_ACCOUNT}"\namount_usd = 100\nthresholds = [0.5, 1.0]\n'
    out = into / experiment.name
    out.write_text(text)
    return out


@dataclass
class LifecycleResult:
    drill: DrillResult
    destroyed: Destroyed
    left: list[Left]
    apis: list[str] = field(default_factory=list)
    promised: tuple[str, ...] = KEPT

    @property
    def unexpected(self) -> list[Left]:
        """What is left that the docs do not promise."""
        return [item for item in self.left if not item.promised]

    @property
    def missing(self) -> list[str]:
        """What the docs promise and the destroy did not keep."""
        return [k for k in self.promised if k not in {item.kind for item in self.left}]

    @property
    def usd_month(self) -> float:
        return sum(item.usd_month or 0.0 for item in self.left)

    @property
    def ok(self) -> bool:
        return (self.drill.ok and not self.destroyed.errors and not self.unexpected and not self.missing
                and sorted(item.kind for item in self.left) == sorted(self.promised))


def promised(spec: Any) -> tuple[str, ...]:
    """The kinds docs/deploy.md says `make destroy` keeps for this experiment."""
    return () if spec.bucket.force_destroy else KEPT


def run_lifecycle(cfg: DrillConfig, say: Callable[[str], None] = print, *,
                  alter: Callable[[dict[str, Any]], None] | None = None,
                  billing_accounts: dict[str, str] | None = None) -> LifecycleResult:
    """Deploy, drill, destroy, inventory. `alter`: changes the synthesized stack before it is
    applied (what a test does to show that the drill catches a leak). `billing_accounts`: the
    accounts the deployer holds billing.budgets.create on, each with its currency; None: the
    experiment's budget account, in ACCOUNT_CURRENCY (a project role grants none)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="spottrain-lifecycle-") as tmp, \
            FakeProject("", log=Path(tmp) / "gcs-emulator.log") as project:
        spec: list[Any] = []

        def deploy(r: Rendered) -> FakeProject:
            stack = stack_json(r)
            if alter is not None:
                alter(stack)
            project.project = r.spec.gcp.project
            if billing_accounts is not None:
                project.billing_accounts = dict(billing_accounts)
            elif r.spec.budget is not None:
                project.billing_accounts = {r.spec.budget.billing_account: ACCOUNT_CURRENCY}
            try:
                project.apply(stack, dict(r.uploads))
            except ProjectError as e:
                raise DrillFailure(f"apply: {e}") from None
            spec.append(r.spec)
            say(f"deploy: applied stack {r.name} to the fake project {project.project}: "
                f"{len(project.state)} resources in the state, bucket {project.bucket} holding "
                f"{len(project.objects())} code object(s)")
            say(watch_summary(stack, project))
            return project

        result = run_drill(cfg, say, deploy=deploy)
        destroyed = project.destroy()
        say(f"destroy: {len(destroyed.deleted)} deleted, {len(destroyed.forgotten)} forgotten (left in the project), "
            f"{sum(map(len, destroyed.objects_deleted.values()))} object(s) deleted"
            + "".join(f"\n  Error: {e}" for e in destroyed.errors))
        keep = promised(spec[0])
        left, apis = project.left(keep)
        out = LifecycleResult(result, destroyed, left, apis, keep)
        say(report(out))
        return out


def watch_summary(stack: dict[str, Any], project: FakeProject) -> str:
    """One line on what the apply created of the watch stack, and when on its clock."""
    resources = stack.get("resource", {})
    policies = [f"google_monitoring_alert_policy.{k}" for k in resources.get("google_monitoring_alert_policy", {})]
    waited = [a for a in policies if project.created.get(a, 0.0) > 0]
    channels = sorted(str(c.get("type")) for c in resources.get("google_monitoring_notification_channel", {}).values())
    budgets = [str(b.get("billing_account")) for b in resources.get("google_billing_budget", {}).values()]
    return (f"watch: {len(policies)} alert policies ({len(waited)} created {project.clock:.0f} s into the apply, "
            f"once their log-based metrics were known), {len(resources.get('google_logging_metric', {}))} "
            f"log-based metrics, channels: {', '.join(channels) or 'none'}, budget: "
            f"{', '.join(f'billingAccounts/{b}' for b in budgets) or 'none'}")


def _money(x: float | None) -> str:
    if x is None:
        return "not priced"
    return f"${x:.4f}" if 0 < x < 0.01 else f"${x:,.2f}"


def report(r: LifecycleResult) -> str:
    lines = ["", "## What the experiment leaves behind (deploy, train, preempt, finish, scale to zero, destroy)", "",
             "| resource | name | size | Terraform state | per month | promised |", "|---|---|---|---|---|---|"]
    for item in r.left:
        lines.append(f"| {item.label} | {item.name} | {item.size} | {item.terraform} | {_money(item.usd_month)} | "
                     f"{'yes' if item.promised else 'NO'} |")
    if not r.left:
        lines.append("| (nothing) | | | | | |")
    lines.append(f"\ntotal {_money(r.usd_month)}/month at list prices (Secret Manager's first 6 active versions "
                 "of a billing account are free)")
    if r.apis:
        lines.append(f"APIs left enabled (no charge; `disable_on_destroy = false`): {', '.join(sorted(r.apis))}")
    for e in r.destroyed.errors:
        lines.append(f"destroy error: {e}")
    if r.ok:
        lines.append("lifecycle: PASS: " + ("exactly the documented bucket and key remain" if r.promised
                                            else "nothing of the experiment remains"))
    else:
        why = [f"{item.label} {item.name} ({item.size}; {_money(item.usd_month)}/month), which no Terraform state "
               f"knows" if item.terraform == "nobody" else f"{item.label} {item.name} ({_money(item.usd_month)}/month)"
               for item in r.unexpected]
        why += [f"the destroy did not keep the {k.removeprefix('google_')} docs/deploy.md promises" for k in r.missing]
        if r.destroyed.errors:
            why.append("the destroy failed")
        if not r.drill.ok:
            why.append("the drill itself failed (see above)")
        lines.append("lifecycle: FAIL: left behind: " + "; ".join(why) if why else "lifecycle: FAIL")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m drill.lifecycle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiment", default=str(DrillConfig.experiment),
                   help="a TOML file, or NAME for experiments/NAME.toml (default: the example)")
    p.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    p.add_argument("--preemptions", type=int, default=1, help="preemptions before the finish (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seeds the preemption moments")
    p.add_argument("--keep", type=Path, help="keep VM state, journals and disks in this directory")
    p.add_argument("--as-written", action="store_true",
                   help="apply the experiment file unchanged (default: watched, with channels and a budget added)")
    a = p.parse_args(argv)
    import tempfile

    from stacks.errors import InputError, report as report_error
    from stacks.load import resolve

    try:
        experiment = resolve(a.experiment)
    except InputError as e:
        return report_error(e)
    with tempfile.TemporaryDirectory(prefix="spottrain-lifecycle-exp-") as tmp:
        if not a.as_written:
            try:
                experiment = watched(experiment, Path(tmp))
            except InputError as e:
                return report_error(e)
            except OSError as e:
                print(f"lifecycle: {a.experiment}: {e.strerror or e}", file=sys.stderr)
                return 2
        return _main(a, experiment)


def _main(a: argparse.Namespace, experiment: Path) -> int:
    from stacks.errors import InputError, report as report_error

    cfg = DrillConfig(experiment=experiment, steps=a.steps, preemptions=a.preemptions, seed=a.seed, workdir=a.keep)
    try:
        check(cfg)
        render(cfg, health_port=8471)  # the experiment file: validated before anything starts
        drill_wheels(cfg)
    except ValueError as e:
        print(f"lifecycle: {e}", file=sys.stderr)
        return 2
    except InputError as e:
        return report_error(e)
    except OSError as e:
        print(f"lifecycle: {a.experiment}: {e.strerror or e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("lifecycle: needs root (the drill's mount and PID namespaces, loop devices)", file=sys.stderr)
        return 2
    try:
        result = run_lifecycle(cfg)
    except DrillFailure as e:
        print(f"lifecycle FAILED: {e}", file=sys.stderr)
        return 1
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
