"""`python -m stacks.review BASE [HEAD]`: what a change does to the infrastructure, offline.

Synthesizes two revisions of the repository (each with its own code, in a subprocess: `git
archive` of the revision into a temporary folder, or the working tree when HEAD is omitted),
then compares every experiment's `cdk.tf.json` resource by resource: added, removed, and changed
with the attribute paths that changed (old -> new). Changes that replace what holds training
state are flagged: the instance group, the checkpoint disk (the template's checkpoint disk entry,
the group's stateful disk policy, a group scaled to zero) and the bucket. No cloud credentials,
no Terraform: this is the plan summary the pull-request workflow posts when it cannot run
`cdktn diff`. Output is markdown. Exit 0; 2 with a message on a bad revision or experiment file.

A change of the VM's locked dependencies (`make lock`, docs/dependencies.md) is named as what it is:
a VM roll (the wheels archive is new, so the startup script and the instance template change and
the group recreates the VM), with the packages whose versions changed, read from the pins each
revision's wheels archive carries.

For each experiment it also says what the change does to the running job, and for every edit of
its experiment file: it RESUMES (the VM and its trainer are untouched), RESTARTS (the group
recreates the VM; the trainer saves on the way down and the new VM resumes from that checkpoint),
or is REFUSED (the trainer's resume fingerprint changes: the new VM's trainer exits 2 on the run's
checkpoints). The fingerprint is the trainer's own (`RunConfig.fingerprint`), computed from the
settings each revision's VM would run with, read back from its synthesized startup script
(trainer.sh's command line and the `[trainer.config]` file) through the trainer's own loader.
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
    job: str = ""  # what the running job does: "resumes" | "restarts" | "refused" ("" no job change)
    job_lines: list[str] = field(default_factory=list)
    edits: list[str] = field(default_factory=list)  # the experiment file's edits, each with its verdict
    dependencies: list[str] = field(default_factory=list)  # the lock's version changes ("a 1 -> 2", "+b 1")


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


def default_base(repo: Path) -> str:
    """The revision a review compares with when none is named: the branch the current one tracks
    (what a pull request would merge into), else the clone's origin/HEAD; ReviewError otherwise."""
    for rev in ("@{upstream}", "origin/HEAD"):
        run = _git(repo, "rev-parse", "--verify", "--quiet", "--symbolic-full-name", rev, text=True)
        if run.returncode == 0 and run.stdout.strip():
            name = run.stdout.strip()
            return name.removeprefix("refs/remotes/").removeprefix("refs/heads/")
    raise ReviewError("no revision to compare with: the branch tracks none and there is no origin/HEAD; "
                      "name one, e.g. make review BASE=origin/main")


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
    from stacks.wheels import CACHE_ENV, cache_root

    if not (tree / "main.py").is_file():
        raise ReviewError(f"{label}: no main.py (not a spottrain revision?)")
    env = {k: v for k, v in os.environ.items() if k != "SPOTTRAIN_EXPERIMENTS"}
    env.update(CDKTF_OUTDIR=str(outdir), CHECKPOINT_DISABLE="1", DISABLE_VERSION_CHECK="1",
               PYTHONDONTWRITEBYTECODE="1")
    # Every revision's locked wheels come from this checkout's cache (keyed by the pins): an
    # exported tree has none of its own, and the same lock is fetched once, not per revision.
    env.setdefault(CACHE_ENV, str(cache_root().resolve()))
    run = subprocess.run([sys.executable, "main.py"], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=SYNTH_TIMEOUT_S)
    if run.returncode:
        detail = run.stderr.strip() or run.stdout.strip()
        if run.returncode != 2:  # a crash, not a validation message: keep its last lines
            detail = "\n".join(detail.splitlines()[-15:])
        sep = "\n" if "\n" in detail else " "  # one problem: one line
        raise ReviewError(f"{label} does not synthesize:{sep}{detail}")
    stacks = outdir / "stacks"
    found = {p.parent.name: json.loads(p.read_text()) for p in stacks.glob("*/cdk.tf.json")}
    return found


PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def pins(stack: dict[str, Any], stack_dir: Path) -> dict[str, str] | None:
    """{package: version} the stack's VM installs: the pins inside its wheels archive
    (`requirements.lock`), or None when it ships no wheels."""
    import tarfile

    for obj in stack.get("resource", {}).get("google_storage_bucket_object", {}).values():
        if not str(obj.get("name", "")).startswith("code/wheels-"):
            continue
        try:
            with tarfile.open(stack_dir / obj["source"]) as tar:
                member = tar.extractfile("requirements.lock")
                text = member.read().decode() if member is not None else ""
        except (OSError, KeyError, tarfile.TarError):
            return None
        found = (PIN.match(line.strip()) for line in text.splitlines())
        return {re.sub(r"[-_.]+", "-", m[1]).lower(): m[2] for m in found if m}
    return None


def dependency_changes(old: dict[str, str] | None, new: dict[str, str] | None) -> list[str]:
    if old is None or new is None or old == new:
        return []
    out = []
    for name in sorted(old.keys() | new.keys()):
        if name not in old:
            out.append(f"+{name} {new[name]}")
        elif name not in new:
            out.append(f"-{name} {old[name]}")
        elif old[name] != new[name]:
            out.append(f"{name} {old[name]} -> {new[name]}")
    return out


def synthesize_revision(repo: Path, rev: str | None, work: Path) -> tuple[str, dict, dict, dict]:
    """(label, stacks, experiment files, each stack's dependency pins) of a revision; rev None is
    the working tree as it is."""
    out = work / ("head-out" if rev is None else f"out-{rev.replace('/', '_')}")
    out.mkdir(parents=True)
    if rev is None:
        label, tree = "working tree", repo
        stacks = synthesize(repo, out, "the working tree")
    else:
        commit = resolve(repo, rev)
        tree = work / f"tree-{commit[:12]}-{len(list(work.iterdir()))}"
        tree.mkdir()
        export(repo, commit, tree)
        label = f"{rev} ({commit[:12]})" if not commit.startswith(rev) else commit[:12]
        stacks = synthesize(tree, out, label)
    found = {name: pins(stack, out / "stacks" / name) for name, stack in stacks.items()}
    return label, stacks, experiment_files(tree), found


def experiment_files(tree: Path) -> dict[str, dict[str, Any]]:
    """{stack name: parsed experiment TOML} of a tree (unparsable files are left out: the
    synthesis already said what is wrong with them)."""
    import tomllib

    out = {}
    for path in sorted((tree / "experiments").glob("*.toml")):
        try:
            out[path.stem] = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            continue
    return out


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
                   "its VM from the new template; the trainer saves on shutdown (whether the new "
                   "VM resumes: see \"running job\")")
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


def diff(old: dict[str, dict], new: dict[str, dict], old_files: dict[str, dict] | None = None,
         new_files: dict[str, dict] | None = None, old_pins: dict[str, Any] | None = None,
         new_pins: dict[str, Any] | None = None) -> list[StackDiff]:
    out = []
    for n in sorted(old.keys() | new.keys()):
        d = diff_stack(n, old.get(n), new.get(n))
        judge_job(d, old.get(n), new.get(n), (old_files or {}).get(n), (new_files or {}).get(n))
        d.dependencies = dependency_changes((old_pins or {}).get(n), (new_pins or {}).get(n))
        out.append(d)
    return out


# --- what the running job does ----------------------------------------------------------------

VERDICTS = {
    "refused": "**REFUSED**",
    "restarts": "**RESTARTS** (new VM, same checkpoint)",
    "resumes": "**RESUMES** (the VM and its trainer are untouched)",
}
TRAINER_SH, CONFIG_TOML = "/etc/spottrain/trainer.sh", "/etc/spottrain/trainer.toml"
_RUN = re.compile(r"-m trainer run \\\n(.*?) &\n", re.S)


def _written_file(script: str, path: str) -> str | None:
    """The content the startup script writes to `path` (`write_if_changed PATH MODE 'TEXT'`)."""
    import shlex

    at = script.find(f"write_if_changed {path} ")
    if at < 0:
        return None
    lexer = shlex.shlex(script[at:], posix=True)
    lexer.whitespace_split = True
    words = [lexer.get_token() for _ in range(4)]
    return words[3]


def trainer_settings(stack: dict[str, Any] | None) -> Any:
    """The `trainer.config.RunConfig` the stack's VMs run with, from its synthesized startup script
    (trainer.sh's command line and the `[trainer.config]` file), loaded the way the VM loads it;
    None when the stack has none or it cannot be read back (an older script layout)."""
    import shlex

    from trainer.cli import parser
    from trainer.config import ConfigError, RunConfig, load_run_config

    scripts = [r.get("metadata", {}).get("startup-script") for r in
               (stack or {}).get("resource", {}).get(TEMPLATE, {}).values()]
    script = next((x for x in scripts if isinstance(x, str)), None)
    trainer_sh = _written_file(script, TRAINER_SH) if script else None
    m = _RUN.search(trainer_sh or "")
    if m is None or script is None:
        return None
    # `${VAR:-default}` is what the VM passes unless its boot set VAR (the shutdown window's
    # budget: the template's own provisioning's); any other variable is the VM's alone.
    words = [re.sub(r"^\$\{[A-Z0-9_]+:-([^}]*)\}$", r"\1", w)
             for w in shlex.split(m[1].replace("\\\n", " "))]
    words = [w for w in words if not w.startswith("${")]
    args, _ = parser().parse_known_args(["run", *words])
    cli = {k: v for k, v in vars(args).items() if k in RunConfig.model_fields}
    config = _written_file(script, CONFIG_TOML) if "--config" in words else None
    with tempfile.TemporaryDirectory(prefix="spottrain-review-cfg-") as tmp:
        path = None
        if config is not None:
            path = Path(tmp) / "trainer.toml"
            path.write_text(config)
        try:
            return load_run_config(cli, path)
        except ConfigError:
            return None


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """An experiment file's values by dotted key; lists are values."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def _edit_setting(key: str) -> str | None:
    """The trainer setting an experiment key sets, by the shared names: `trainer.config.X...` and
    `trainer.X` are the trainer's X (`[trainer.config]` takes the trainer's own names)."""
    parts = key.split(".")
    if parts[:2] == ["trainer", "config"] and len(parts) > 2:
        return parts[2]
    if parts[0] == "trainer" and len(parts) == 2:
        return parts[1]
    return None


def _device(stack: dict, settings: Any) -> str:
    """The device the VMs' trainer resolves: the trainer's fingerprint holds that, not the setting,
    so `device = "auto"` on a GPU machine is "cuda" (an edit to "cuda" there changes nothing)."""
    if settings.device != "auto":
        return settings.device
    from stacks.gcp_rules import MACHINE_TYPES

    for t in stack.get("resource", {}).get(TEMPLATE, {}).values():
        shape = MACHINE_TYPES.get(t.get("machine_type", ""))
        if t.get("guest_accelerator") or (shape is not None and shape.gpu_count > 0):
            return "cuda"
    return "cpu"


def judge_job(d: StackDiff, old: dict | None, new: dict | None, old_file: dict | None,
              new_file: dict | None) -> None:
    """Fill `d.job`, `d.job_lines` and `d.edits`: what the running job does with this change."""
    if old is None or new is None:
        return
    before, after = trainer_settings(old), trainer_settings(new)
    refused: dict[str, tuple[Any, Any]] = {}
    extended = None
    if before is not None and after is not None:
        a = before.fingerprint(dataset_len=0, device=_device(old, before))
        b = after.fingerprint(dataset_len=0, device=_device(new, after))
        refused = {k: (a.get(k, MISSING), b.get(k, MISSING)) for k in sorted(a.keys() | b.keys())
                   if a.get(k, MISSING) != b.get(k, MISSING)}
        if "steps" in refused and getattr(after, "extend_steps", False):
            extended = refused.pop("steps")
    replaced = [c for c in d.changes if c.type in (TEMPLATE, *GROUPS) or
                (c.type == INSTANCE and any(_top(x.path) in FORCE_NEW[INSTANCE] for x in c.attrs))]
    if refused:
        d.job = "refused"
        what = ", ".join(f"{k} {_value(o)} -> {_value(n)}" for k, (o, n) in refused.items())
        hint = ""
        if "steps" in refused:
            hint = (" To continue this run to the new total, set `extend_steps = true` in "
                    "`[trainer.config]`." if "extend_steps" in type(after).model_fields else "")
        d.job_lines.append(
            f"running job: {VERDICTS['refused']}: the trainer's resume fingerprint changes ({what}): "
            "the new VM's trainer refuses this run's checkpoints and exits 2 (it is not restarted). "
            f"Keep the old values, or train a new run under another experiment name.{hint}")
    elif replaced:
        d.job = "restarts"
        unread = before is None or after is None
        d.job_lines.append(f"running job: {VERDICTS['restarts']}: the group recreates the VM; the "
                           "trainer saves on the way down and the new VM resumes from the newest "
                           + ("checkpoint (the trainer's settings could not be read back from one "
                              "revision's startup script: whether its checkpoints accept the new "
                              "ones is unchecked)" if unread else
                              "checkpoint with the same fingerprint"))
    elif d.changes:
        d.job = "resumes"
        d.job_lines.append(f"running job: {VERDICTS['resumes']}: nothing the VM runs changes")
    if extended is not None and d.job != "refused":
        d.job_lines.append(f"steps {_value(extended[0])} -> {_value(extended[1])} with extend_steps: "
                           "the run continues to the new total (refused if it has already passed it)")
    if before is not None and after is not None and d.job:
        others = [k for k in _trainer_fields() if k not in refused and
                  getattr(before, k) != getattr(after, k) and k not in ("steps",)]
        if others:
            d.job_lines.append("trainer settings outside the fingerprint change: " + ", ".join(
                f"{k} {_value(getattr(before, k))} -> {_value(getattr(after, k))}" for k in others))
    if old_file is None or new_file is None or not d.job:
        return
    a, b = _flat(old_file), _flat(new_file)
    explained = set()
    for key in sorted(a.keys() | b.keys()):
        if a.get(key, MISSING) == b.get(key, MISSING):
            continue
        setting = _edit_setting(key)
        if setting in refused:
            explained.add(setting)
            verdict = f"{VERDICTS['refused']} (in the resume fingerprint)"
        elif key.startswith("trainer.args") and refused.keys() - explained:
            verdict = f"{VERDICTS['refused']} (the flags change the resume fingerprint)"
        elif setting == "steps" and extended is not None:
            verdict = "extends the run (extend_steps)"
        else:
            verdict = {"refused": "applies; the running job is refused for the edits above",
                       "restarts": "restarts with the change as a whole (new VM, same checkpoint)",
                       "resumes": "resumes (the running VM is untouched)"}[d.job]
        d.edits.append(f"`{key}`: {_value(a.get(key, MISSING))} -> {_value(b.get(key, MISSING))}: "
                       f"{verdict}")


def _trainer_fields() -> list[str]:
    """The trainer settings worth naming when they change (not the stack's paths and prices)."""
    from trainer.config import RunConfig

    skip = {"run_dir", "gcs_uri", "local_dir", "price_per_hour", "on_demand_price_per_hour"}
    return [k for k in RunConfig.model_fields if k not in skip]


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
        for line in d.job_lines:
            lines.append(f"- {':warning: ' if 'REFUSED' in line else ''}{line}")
        if d.dependencies:
            lines.append("- dependencies: **VM ROLL**: the lock of the VM's packages changes ("
                         + ", ".join(d.dependencies) + "): the wheels archive is new, so the startup "
                         "script and the instance template change and the group recreates the VM")
        if d.edits:
            lines.append(f"- edits of `experiments/{d.name}.toml`:")
            lines += [f"  - {e}" for e in d.edits]
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
        head_label, new, new_files, new_pins = synthesize_revision(repo, head, work)
        base_label, old, old_files, old_pins = synthesize_revision(repo, base, work)
    return render(diff(old, new, old_files, new_files, old_pins, new_pins), base_label, head_label)


# --- for the pull-request workflow --------------------------------------------------------------

#: Paths whose change can alter every experiment's stack.
SHARED = ("stacks/", "templates/", "trainer/", "locks/", "main.py", "cdktf.json")


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
    parser.add_argument("base", metavar="BASE_REV", nargs="?",
                        help="the revision to compare with (default: the branch the current one tracks, "
                        "else origin/HEAD)")
    parser.add_argument("head", metavar="HEAD_REV", nargs="?")
    parser.add_argument("--changed", action="store_true",
                        help="only print the experiments a change since BASE_REV affects")
    parser.add_argument("--plan-summary", action="store_true",
                        help="BASE_REV is a folder of <experiment>.txt `cdktn diff` outputs: "
                        "print their summary")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.plan_summary:
            if args.base is None:
                raise ReviewError("--plan-summary needs the folder of plan outputs")
            folder = Path(args.base)
            if not folder.is_dir():
                raise ReviewError(f"{folder}: no such folder of plan outputs")
            print(summarize_plans(folder), end="")
            return 0
        repo = repo_root(Path.cwd())
        if args.base is None:
            args.base = default_base(repo)
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
