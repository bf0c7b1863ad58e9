"""`python -m stacks.review BASE [HEAD]`: what a change does to the infrastructure, offline.

Synthesizes two revisions of the repository (each with its own code, in a subprocess: `git
archive` of the revision into a temporary folder, or the working tree when HEAD is omitted),
then compares every experiment's `cdk.tf.json` resource by resource: added, removed, and changed
with the attribute paths that changed (old -> new). Changes that replace what holds training
state are flagged: the instance group, the checkpoint disk (the template's checkpoint disk entry,
the group's stateful disk policy, a group scaled to zero) and the bucket. No cloud credentials,
no Terraform: this is the plan summary the pull-request workflow posts when it cannot run
`cdktn diff`. Output is markdown. Exit 0; 2 with a message on a bad revision or experiment file.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The device name the template gives the checkpoint disk (stacks.boot.DEVICE_NAME); repeated
#: here because an old revision's value is what its JSON holds.
CHECKPOINT_DEVICE = "spottrain-checkpoints"
GROUPS = ("google_compute_instance_group_manager", "google_compute_region_instance_group_manager")
BUCKET = "google_storage_bucket"
TEMPLATE = "google_compute_instance_template"
#: A pool's coordinator (`stacks.coordinator`): its VM and its own checkpoint disk.
INSTANCE, DISK = "google_compute_instance", "google_compute_disk"
#: Attributes the google provider cannot update in place (ForceNew): a change replaces.
FORCE_NEW = {
    GROUPS[0]: {"name", "zone", "project", "base_instance_name"},
    GROUPS[1]: {"name", "region", "project", "base_instance_name", "distribution_policy_zones"},
    BUCKET: {"name", "location", "project"},
    # `metadata_startup_script` too: the coordinator is recreated when its boot scripts change.
    INSTANCE: {"name", "zone", "project", "metadata_startup_script", "boot_disk"},
    DISK: {"name", "zone", "project", "type"},
}
SYNTH_TIMEOUT_S = 600
MAX_VALUE = 60


class ReviewError(Exception):
    """Bad input (revision, experiment file); the message is for the user."""


@dataclass(frozen=True)
class AttrChange:
    path: str
    old: Any  # MISSING when added
    new: Any  # MISSING when removed


class _Missing:
    def __repr__(self) -> str:
        return "(none)"


MISSING: Any = _Missing()


@dataclass
class ResourceChange:
    address: str  # type.name
    action: str  # "added" | "removed" | "changed"
    attrs: list[AttrChange] = field(default_factory=list)

    @property
    def type(self) -> str:
        return self.address.split(".", 1)[0]


@dataclass
class StackDiff:
    name: str
    status: str  # "changed" | "added" | "removed" | "unchanged"
    changes: list[ResourceChange] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)  # replacements of stateful resources
    notes: list[str] = field(default_factory=list)  # consequences worth knowing, not alarming


# --- synthesis ---------------------------------------------------------------------------------


def _git(repo: Path, *args: str, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, **kw)


def repo_root(start: Path) -> Path:
    run = _git(start, "rev-parse", "--show-toplevel", text=True)
    if run.returncode:
        raise ReviewError(f"{start}: not inside a git repository")
    return Path(run.stdout.strip())


def resolve(repo: Path, rev: str) -> str:
    """The commit id of `rev`, or ReviewError naming it."""
    run = _git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}",
               text=True)
    if run.returncode or not run.stdout.strip():
        raise ReviewError(f"{rev!r} is not a revision of {repo} (try a branch, tag or commit, "
                          "e.g. origin/main; in CI, fetch with fetch-depth: 0)")
    return run.stdout.strip()


def export(repo: Path, commit: str, dest: Path) -> None:
    """The tree of `commit` under dest (tracked files only, as the commit has them)."""
    archive = _git(repo, "archive", "--format=tar", commit)
    if archive.returncode:
        raise ReviewError(f"git archive {commit[:12]} failed: {archive.stderr.decode().strip()}")
    untar = subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout,
                           capture_output=True)
    if untar.returncode:
        raise ReviewError(f"cannot unpack {commit[:12]}: {untar.stderr.decode().strip()}")


def synthesize(tree: Path, outdir: Path, label: str) -> dict[str, dict[str, Any]]:
    """Run the tree's own app (`main.py`) into outdir; {stack name: cdk.tf.json}."""
    if not (tree / "main.py").is_file():
        raise ReviewError(f"{label}: no main.py (not a spottrain revision?)")
    env = {k: v for k, v in os.environ.items() if k != "SPOTTRAIN_EXPERIMENTS"}
    env.update(CDKTF_OUTDIR=str(outdir), CHECKPOINT_DISABLE="1", DISABLE_VERSION_CHECK="1",
               PYTHONDONTWRITEBYTECODE="1")
    run = subprocess.run([sys.executable, "main.py"], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=SYNTH_TIMEOUT_S)
    if run.returncode:
        detail = run.stderr.strip() or run.stdout.strip()
        if run.returncode != 2:  # a crash, not a validation message: keep its last lines
            detail = "\n".join(detail.splitlines()[-15:])
        raise ReviewError(f"{label} does not synthesize:\n{detail}")
    stacks = outdir / "stacks"
    found = {p.parent.name: json.loads(p.read_text()) for p in stacks.glob("*/cdk.tf.json")}
    return found


def synthesize_revision(repo: Path, rev: str | None, work: Path) -> tuple[str, dict]:
    """(label, stacks) of a revision; rev None is the working tree as it is."""
    out = work / ("head-out" if rev is None else f"out-{rev.replace('/', '_')}")
    out.mkdir(parents=True)
    if rev is None:
        return "working tree", synthesize(repo, out, "the working tree")
    commit = resolve(repo, rev)
    tree = work / f"tree-{commit[:12]}-{len(list(work.iterdir()))}"
    tree.mkdir()
    export(repo, commit, tree)
    label = f"{rev} ({commit[:12]})" if not commit.startswith(rev) else commit[:12]
    return label, synthesize(tree, out, label)


# --- diff --------------------------------------------------------------------------------------


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaf values by attribute path: `a.b[0].c`. Empty containers are leaves."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            if k == "//":  # cdktn's construct metadata, not an attribute
                continue
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value:
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def attr_changes(old: dict[str, Any], new: dict[str, Any]) -> list[AttrChange]:
    a, b = flatten(old), flatten(new)
    return [AttrChange(p, a.get(p, MISSING), b.get(p, MISSING))
            for p in sorted(a.keys() | b.keys()) if a.get(p, MISSING) != b.get(p, MISSING)]


def resources(stack: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{t}.{n}": r for t, rs in stack.get("resource", {}).items() for n, r in rs.items()}


def _top(path: str) -> str:
    return path.split(".", 1)[0].split("[", 1)[0]


def _checkpoint_disk(res: dict[str, Any]) -> dict[str, Any] | None:
    for d in res.get("disk", []):
        if d.get("device_name") == CHECKPOINT_DEVICE:
            return d
    return None


def diff_stack(name: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> StackDiff:
    a, b = resources(old or {}), resources(new or {})
    status = "added" if old is None else "removed" if new is None else "changed"
    d = StackDiff(name, status)
    for addr in sorted(a.keys() | b.keys()):
        if addr not in a:
            d.changes.append(ResourceChange(addr, "added"))
        elif addr not in b:
            d.changes.append(ResourceChange(addr, "removed"))
        else:
            attrs = attr_changes(a[addr], b[addr])
            if attrs:
                d.changes.append(ResourceChange(addr, "changed", attrs))
    before, after = _backend(old), _backend(new)
    if old is not None and new is not None and before != after:
        d.notes.append(f"the state backend changes ({_value(before)} -> {_value(after)}): "
                       "migrate the state first (`cdktn diff --migrate-state`), or Terraform "
                       "plans every resource anew")
    if not d.changes and not d.notes:
        d.status = "unchanged"
    _flag(d, a, b)
    return d


def _backend(stack: dict[str, Any] | None) -> Any:
    return (stack or {}).get("terraform", {}).get("backend")


def _flag(d: StackDiff, old: dict[str, Any], new: dict[str, Any]) -> None:
    for c in d.changes:
        kind = c.type
        if kind in GROUPS:
            _flag_group(d, c, old.get(c.address), new.get(c.address))
        elif kind == BUCKET:
            if c.action == "removed":
                d.flags.append(f"DESTROYS the bucket `{c.address}`: the checkpoints go with it "
                               "(or the apply fails while force_destroy = false)")
            elif c.action == "changed":
                forced = [x for x in c.attrs if _top(x.path) in FORCE_NEW[BUCKET]]
                if forced:
                    d.flags.append(
                        f"REPLACES the bucket `{c.address}` ({_attrs_brief(forced)}): a new, "
                        "empty bucket; the old one is deleted with its checkpoints, or the apply "
                        "fails while force_destroy = false")
        elif kind == TEMPLATE:
            _flag_template(d, c, old.get(c.address), new.get(c.address))
        elif kind == DISK:
            forced = [x for x in c.attrs if _top(x.path) in FORCE_NEW[DISK]
                      # the provider replaces a disk it is asked to shrink
                      or (x.path == "size" and isinstance(x.old, int)
                          and isinstance(x.new, int) and x.new < x.old)]
            grown = [x for x in c.attrs if x.path == "size" and x not in forced]
            if c.action == "changed" and grown and not forced:
                d.notes.append(
                    f"`{c.address}` (the coordinator's checkpoint disk) grows in place, "
                    f"{_value(grown[0].old)} -> {_value(grown[0].new)} GB; its filesystem grows at "
                    "the coordinator's next boot (the startup script runs resize2fs)")
            if c.action == "removed" or forced:
                why = f" ({_attrs_brief(forced)})" if forced else ""
                d.flags.append(f"{'REPLACES' if forced else 'DESTROYS'} the coordinator's "
                               f"checkpoint disk `{c.address}`{why}: its local checkpoints go; "
                               "the pool resumes from the bucket")
        elif kind == INSTANCE and c.action == "changed":
            forced = [x for x in c.attrs if _top(x.path) in FORCE_NEW[INSTANCE]]
            if forced:
                d.notes.append(f"`{c.address}` (the pool's coordinator) is recreated "
                               f"({_attrs_brief(forced)}): every node re-rendezvouses and "
                               "resumes from the newest checkpoint; its disk and IP are kept")


def _flag_group(d: StackDiff, c: ResourceChange, old: dict | None, new: dict | None) -> None:
    if c.action == "removed":
        replaced = any(x.action == "added" and x.type in GROUPS for x in d.changes)
        verb = "REPLACES" if replaced else "DESTROYS"
        d.flags.append(f"{verb} the instance group `{c.address}`: its VM and its checkpoint disk "
                       "are deleted; training resumes from the bucket")
        return
    if c.action == "added" or old is None or new is None:
        return
    forced = [x for x in c.attrs if _top(x.path) in FORCE_NEW[c.type]]
    if forced:
        d.flags.append(f"REPLACES the instance group `{c.address}` ({_attrs_brief(forced)}): its "
                       "VM and its checkpoint disk are deleted; training resumes from the bucket")
    stateful = [x for x in c.attrs if _top(x.path) == "stateful_disk"]
    if stateful and not forced:
        d.flags.append(f"REPLACES the checkpoint disk: the stateful disk policy of `{c.address}` "
                       f"changes ({_attrs_brief(stateful)}); the disk kept across repairs may be "
                       "deleted or no longer reattached")
    size = next((x for x in c.attrs if x.path == "target_size"), None)
    if size is not None and new.get("target_size") == 0:
        d.flags.append(f"DELETES the checkpoint disk: `{c.address}` scales to 0 (target_size "
                       f"{_value(size.old)} -> 0); the VM and its disk go, the bucket keeps the "
                       "checkpoints")


def _flag_template(d: StackDiff, c: ResourceChange, old: dict | None, new: dict | None) -> None:
    if c.action != "changed" or old is None or new is None:
        return
    d.notes.append(f"`{c.address}` is replaced (templates are never edited): the group recreates "
                   "its VM from the new template; the trainer saves on shutdown and resumes")
    before, after = _checkpoint_disk(old), _checkpoint_disk(new)
    if before != after:
        if before is None or after is None:
            what = "appears" if before is None else "disappears"
            d.flags.append(f"REPLACES the checkpoint disk: the template's `{CHECKPOINT_DEVICE}` "
                           f"disk {what}")
        else:
            changes = attr_changes(before, after)
            d.flags.append(
                f"CHANGES the checkpoint disk definition in `{c.address}` "
                f"({_attrs_brief(changes, 'disk')}): the group keeps each VM's existing stateful "
                "disk as it is; only a disk created anew (new VM, scale from zero) gets it")
            note = _disk_size_note(before.get("disk_size_gb"), after.get("disk_size_gb"))
            if note:
                d.notes.append(note)


def _disk_size_note(old: Any, new: Any) -> str | None:
    """What a `checkpoint_disk_gb` edit does to a running experiment, and what it does not."""
    if not isinstance(old, int) or not isinstance(new, int) or old == new:
        return None
    if new < old:
        return (f"checkpoint_disk_gb {old} -> {new}: disks cannot shrink; a running VM keeps its "
                f"{old} GB disk, and only a disk created anew (a new VM, a scale from zero) is "
                f"{new} GB")
    return (f"checkpoint_disk_gb {old} -> {new}: a running VM's disk stays {old} GB (the group "
            "keeps its stateful disk; a template change resizes nothing). To grow it now: "
            f"`gcloud compute disks resize DISK --size {new} --zone ZONE` (DISK: the VM's "
            f"`{CHECKPOINT_DEVICE}` disk, from `gcloud compute instances describe INSTANCE`); "
            "the next boot grows its filesystem (the startup script runs resize2fs). A disk "
            f"created anew (a new VM, a scale from zero) is {new} GB")


def diff(old: dict[str, dict], new: dict[str, dict]) -> list[StackDiff]:
    return [diff_stack(n, old.get(n), new.get(n)) for n in sorted(old.keys() | new.keys())]


# --- rendering ---------------------------------------------------------------------------------


def _value(v: Any) -> str:
    if v is MISSING:
        return "(none)"
    text = json.dumps(v)
    if isinstance(v, str) and ("\n" in v or len(v) > MAX_VALUE):
        return f"({len(v.splitlines())} lines of text)"
    return text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 3] + "..."


def _is_text(v: Any) -> bool:
    return isinstance(v, str) and ("\n" in v or len(v) > MAX_VALUE)


def _change(x: AttrChange) -> str:
    """`old -> new`; for two long texts (scripts) the count of lines added and removed."""
    if _is_text(x.old) and _is_text(x.new):
        added = removed = 0
        for line in difflib.ndiff(x.old.splitlines(), x.new.splitlines()):
            added += line.startswith("+ ")
            removed += line.startswith("- ")
        return (f"{_value(x.old)} -> {_value(x.new)}, {added} line(s) added, "
                f"{removed} removed")
    return f"{_value(x.old)} -> {_value(x.new)}"


def _attrs_brief(attrs: list[AttrChange], prefix: str = "") -> str:
    return ", ".join(f"{prefix + '.' if prefix else ''}{x.path} {_value(x.old)} -> "
                     f"{_value(x.new)}" for x in attrs)


def render(diffs: list[StackDiff], base: str, head: str) -> str:
    lines = [f"## spottrain plan review: {base} -> {head}", ""]
    if not diffs:
        lines.append("No experiments in either revision.")
    for d in diffs:
        n = {k: sum(c.action == k for c in d.changes) for k in ("added", "changed", "removed")}
        counts = ", ".join(f"{v} {k}" for k, v in n.items())
        head_line = {
            "unchanged": "no changes",
            "added": f"new experiment: {counts}",
            "removed": f"experiment removed: {counts}",
            "changed": counts,
        }[d.status]
        lines.append(f"### `{d.name}`: {head_line}")
        if d.status == "unchanged":
            lines.append("")
            continue
        for flag in d.flags:
            lines.append(f"- :warning: **{flag}**")
        for note in d.notes:
            lines.append(f"- note: {note}")
        for c in d.changes:
            lines.append(f"- {c.action} `{c.address}`")
            for x in c.attrs:
                lines.append(f"  - `{x.path}`: {_change(x)}")
        lines.append("")
    flagged = sum(len(d.flags) for d in diffs)
    lines.append(f"{flagged} flagged change(s). Offline review of synthesized Terraform JSON; "
                 "a real plan needs `cdktn diff` with credentials.")
    return "\n".join(lines) + "\n"


def review(repo: Path, base: str, head: str | None) -> str:
    with tempfile.TemporaryDirectory(prefix="spottrain-review-") as tmp:
        work = Path(tmp)
        # HEAD first: a broken experiment file in the change fails before the slow base synth.
        head_label, new = synthesize_revision(repo, head, work)
        base_label, old = synthesize_revision(repo, base, work)
    return render(diff(old, new), base_label, head_label)


# --- for the pull-request workflow --------------------------------------------------------------

#: Paths whose change can alter every experiment's stack.
SHARED = ("stacks/", "templates/", "trainer/", "main.py", "cdktf.json")


def changed_experiments(repo: Path, base: str) -> list[str]:
    """Experiments (stack names) of the working tree that a change since `base` can affect: all of
    them when shared code changed, else those whose file changed."""
    commit = resolve(repo, base)
    run = _git(repo, "diff", "--name-only", commit, "--", text=True)  # base vs working tree
    if run.returncode:
        raise ReviewError(f"git diff {base} failed: {run.stderr.strip()}")
    paths = run.stdout.split()
    present = sorted(p.stem for p in (repo / "experiments").glob("*.toml"))
    if any(p.startswith(SHARED) for p in paths):
        return present
    touched = {Path(p).stem for p in paths if p.startswith("experiments/") and p.endswith(".toml")}
    return [n for n in present if n in touched]


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PLAN_ACTION = re.compile(r"#\s+(\S+)\s+(will be created|will be destroyed|must be replaced|"
                         r"will be updated in-place|is tainted, so must be replaced)")
FORCES = re.compile(r"(?:^|\s)[-+~]\s+([A-Za-z_][\w.-]*)\s.*#\s*forces replacement")
PLAN_TOTAL = re.compile(r"(Plan: .*|No changes\..*)$")
STATEFUL = (*GROUPS, BUCKET)


def summarize_plan(name: str, output: str) -> list[str]:
    """The markdown lines for one experiment's `cdktn diff` output (terraform plan text)."""
    lines = [f"### `{name}`"]
    total = None
    for raw in ANSI.sub("", output).splitlines():
        m = PLAN_ACTION.search(raw)
        if m:
            address, action = m[1], m[2]
            warn = address.split(".", 1)[0] in STATEFUL and ("replaced" in action
                                                             or "destroyed" in action)
            lines.append(f"- {':warning: **' if warn else ''}`{address}` {action}"
                         f"{'**' if warn else ''}")
            continue
        f = FORCES.search(raw)
        if f and len(lines) > 1:
            lines.append(f"  - `{f[1]}` forces replacement")
            continue
        t = PLAN_TOTAL.search(raw.strip())
        if t:
            total = t[1]
    if total is None:
        lines.append("- the diff did not finish; see the workflow log")
    else:
        lines.insert(1, total)
    return lines


def summarize_plans(folder: Path) -> str:
    """Markdown from folder/<experiment>.txt, one `cdktn diff` output each."""
    out = ["## spottrain plan (cdktn diff)", ""]
    files = sorted(folder.glob("*.txt"))
    for f in files:
        out += summarize_plan(f.stem, f.read_text(errors="replace")) + [""]
    if not files:
        out.append("No experiment is affected by this change.")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stacks.review",
        description="Offline infrastructure review: synthesize two revisions and compare them "
        "(HEAD: the working tree by default).")
    parser.add_argument("base", metavar="BASE_REV")
    parser.add_argument("head", metavar="HEAD_REV", nargs="?")
    parser.add_argument("--changed", action="store_true",
                        help="only print the experiments a change since BASE_REV affects")
    parser.add_argument("--plan-summary", action="store_true",
                        help="BASE_REV is a folder of <experiment>.txt `cdktn diff` outputs: "
                        "print their summary")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.plan_summary:
            folder = Path(args.base)
            if not folder.is_dir():
                raise ReviewError(f"{folder}: no such folder of plan outputs")
            print(summarize_plans(folder), end="")
            return 0
        repo = repo_root(Path.cwd())
        if args.changed:
            print("\n".join(changed_experiments(repo, args.base)))
            return 0
        if args.head is not None:
            resolve(repo, args.head)  # fail on a bad HEAD before any synthesis
        resolve(repo, args.base)
        print(review(repo, args.base, args.head), end="")
    except ReviewError as err:
        print(f"stacks.review: {err}", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__":
    sys.exit(main())
