"""`python -m stacks.review`: the offline plan review, on a fixture repository with known edits.

The fixture repository is a real git repository holding this project's app (main.py, stacks/,
templates/, trainer/) and one experiment; its second commit changes the machine type, the GPU
count and the bucket location. The review command synthesizes both commits (two syntheses for
the whole module, shared by the tests in one xdist group) and must report exactly those changes.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from stack_support import EXAMPLE, ROOT

from stacks import review

APP = ["main.py", "cdktf.json", "stacks", "templates", "trainer", "locks"]
TEMPLATE = "google_compute_instance_template"


def git(repo: Path, *args: str) -> str:
    run = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def set_key(text: str, key: str, value: str) -> str:
    new, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    assert n == 1, key
    return new


def run_review(repo: Path, *revs: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stacks.review", *revs], cwd=repo,
                          capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def fixture_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("fixture-repo")
    for name in APP:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, repo / name)
    (repo / ".gitignore").write_text("__pycache__/\ncdktf.out/\n")
    (repo / "experiments").mkdir()
    exp = repo / "experiments" / "fixture.toml"
    text = set_key(EXAMPLE.read_text(), "machine_type", '"n1-standard-8"')
    exp.write_text(set_key(text, "gpu_type", '"nvidia-tesla-t4"'))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "base")
    text = set_key(exp.read_text(), "machine_type", '"n1-standard-16"')
    text = set_key(text, "gpu_count", "2")
    exp.write_text(set_key(text, "bucket_location", '"US-EAST1"'))
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qam",
        "bigger machine, two GPUs, bucket moves")
    return repo


@pytest.fixture(scope="module")
def reviewed(fixture_repo) -> str:
    run = run_review(fixture_repo, "main~1", "main")
    assert run.returncode == 0, run.stderr
    return run.stdout


def _changes(markdown: str) -> dict[str, list[str]]:
    """{'changed google_x.y': ['path: old -> new', ...]} from the review's bullet list."""
    found: dict[str, list[str]] = {}
    current = None
    for line in markdown.splitlines():
        m = re.match(r"^- (added|removed|changed) `([^`]+)`$", line)
        if m:
            current = f"{m[1]} {m[2]}"
            found[current] = []
        elif line.startswith("  - ") and current:
            found[current].append(line[4:].replace("`", ""))
        else:
            current = None
    return found


@pytest.mark.xdist_group("review")
def test_review_reports_exactly_the_edits(reviewed):
    changes = {re.sub(r"\.[^ ]+$", "", k).replace(" ", ":"): v
               for k, v in _changes(reviewed).items()}
    # The script's length is the template's business; the edit is two lines either way.
    changes[f"changed:{TEMPLATE}"] = [re.sub(r"\(\d+ lines of text\)", "(N lines of text)", c)
                                      for c in changes.get(f"changed:{TEMPLATE}", [])]
    assert changes == {
        f"changed:{TEMPLATE}": [
            "guest_accelerator[0].count: 1 -> 2",
            'machine_type: "n1-standard-8" -> "n1-standard-16"',
            # A bigger machine costs more: the trainer's --price-per-hour and
            # --on-demand-price-per-hour words in the startup script change with it; and two
            # GPUs make trainer.sh run torchrun with two ranks (and read back their statuses).
            "metadata.startup-script: (N lines of text) -> (N lines of text), "
            "32 line(s) added, 3 removed",
        ],
        "changed:google_storage_bucket": ['location: "US-CENTRAL1" -> "US-EAST1"'],
        # The control job knows the stop markers' names, and the bad-input marker is named by the
        # startup script's digest: the job's settings follow the script (no VM roll from this).
        "changed:google_cloud_run_v2_job": [
            "template.template.containers[0].env[3].value: (1 lines of text) -> (1 lines of text), "
            "1 line(s) added, 1 removed"],
    }
    assert "### `fixture`: 0 added, 3 changed, 0 removed" in reviewed


@pytest.mark.xdist_group("review")
def test_review_flags_only_the_bucket_replacement(reviewed):
    flags = [line for line in reviewed.splitlines() if line.startswith("- :warning:")]
    assert len(flags) == 1
    assert flags[0].startswith("- :warning: **REPLACES the bucket `google_storage_bucket.")
    assert 'location "US-CENTRAL1" -> "US-EAST1"' in flags[0]
    assert "1 flagged change(s)" in reviewed
    assert f"note: `{TEMPLATE}." in reviewed and "the group recreates its VM" in reviewed
    assert reviewed.startswith("## spottrain plan review: main~1 (")


@pytest.mark.xdist_group("review")
def test_review_says_what_the_running_job_does_with_each_edit(reviewed):
    # A second GPU: a new VM with two ranks; the world size is not in the fingerprint.
    assert "- running job: **RESTARTS** (new VM, same checkpoint): the group recreates the VM" \
        in reviewed
    restart = "restarts with the change as a whole (new VM, same checkpoint)"
    for edit in ('`bucket.bucket_location`: "US-CENTRAL1" -> "US-EAST1"',
                 "`machine.gpu_count`: 1 -> 2", '`machine.machine_type`: "n1-standard-8" -> "n1-standard-16"'):
        assert f"  - {edit}: {restart}" in reviewed


@pytest.mark.xdist_group("review")
def test_review_of_the_working_tree_and_bad_input(fixture_repo, tmp_path):
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(fixture_repo), str(clone))
    bad = run_review(clone, "no-such-rev")
    assert bad.returncode == 2 and "'no-such-rev' is not a revision of" in bad.stderr
    assert bad.stdout == "" and "Traceback" not in bad.stderr
    exp = clone / "experiments" / "fixture.toml"
    exp.write_text(set_key(exp.read_text(), "gpu_count", "3"))
    broken = run_review(clone, "main")  # HEAD: the working tree, which no longer validates
    assert broken.returncode == 2, broken.stdout
    assert "the working tree does not synthesize" in broken.stderr
    assert "experiments/fixture.toml: machine.gpu_count: 3 x nvidia-tesla-t4 is not a valid " \
        "count" in broken.stderr
    assert "Traceback" not in broken.stderr
    # No BASE: the branch the clone's main tracks, so the same working tree is reviewed.
    default = run_review(clone)
    assert default.returncode == 2 and "the working tree does not synthesize" in default.stderr


def test_without_a_base_the_review_compares_with_the_tracked_branch(fixture_repo, tmp_path):
    """`make review` with no BASE: the branch the current one tracks, else origin/HEAD, else one
    line naming what to pass (a fresh clone's user typed `make review` and got argparse's usage)."""
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(fixture_repo), str(clone))
    assert review.default_base(clone) == "origin/main"
    git(clone, "checkout", "-q", "-b", "topic", "--no-track", "main~1")
    assert review.default_base(clone) == "origin/main"  # origin/HEAD, as the branch it names
    with pytest.raises(review.ReviewError, match="name one, e.g. make review BASE=origin/main"):
        review.default_base(fixture_repo)  # no remote at all
    lonely = run_review(fixture_repo)
    assert lonely.returncode == 2 and "make review BASE=origin/main" in lonely.stderr
    assert "Traceback" not in lonely.stderr


@pytest.mark.xdist_group("review")
def test_a_lock_change_is_named_a_vm_roll_with_the_packages_that_changed(fixture_repo, tmp_path):
    """`make lock --upgrade` moved one package: the review says the VM rolls, and which package
    moved from which version to which (read from the wheels each revision ships)."""
    from stacks.wheels import build_wheel, locked_wheels, read_lock

    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(fixture_repo), str(clone))
    lock_file = clone / "locks" / "py3.10-glibc2.35.lock"
    before = read_lock(lock_file)
    # An index with the locked wheels and a newer certifi (a stand-in for the next release).
    index = tmp_path / "index"
    index.mkdir()
    for wheel in locked_wheels(before).glob("*.whl"):
        os.link(wheel, index / wheel.name)
    newer = build_wheel(index, "certifi", "2099.1.1")
    (old,) = [p for p in before.pins if p.name == "certifi"]
    sha = hashlib.sha256(newer.read_bytes()).hexdigest()
    text = lock_file.read_text().replace(f"# {old.file}\ncertifi=={old.version} \\\n    --hash=sha256:{old.sha256}",
                                         f"# {newer.name}\ncertifi==2099.1.1 \\\n    --hash=sha256:{sha}")
    assert text != lock_file.read_text()
    lock_file.write_text(text)
    git(clone, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qam", "make lock --upgrade")
    run = run_review(clone, "HEAD~1", "HEAD", env={"SPOTTRAIN_WHEEL_INDEX": str(index),
                                                    "SPOTTRAIN_WHEEL_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr
    assert (f"- dependencies: **VM ROLL**: the lock of the VM's packages changes (certifi {old.version} -> "
            "2099.1.1): the wheels archive is new, so the startup script and the instance template change "
            "and the group recreates the VM") in run.stdout
    assert "- running job: **RESTARTS** (new VM, same checkpoint)" in run.stdout
    changed = _changes(run.stdout)
    assert any(k.startswith(f"changed {TEMPLATE}.") for k in changed), run.stdout
    assert all("certifi" not in line for line in run.stdout.splitlines() if line.startswith("- :warning:"))


# --- the diff rules on hand-made stacks (no synthesis) -------------------------------------------

GROUP = "google_compute_instance_group_manager"


def _stack(**resources) -> dict:
    out: dict = {"resource": {}}
    for address, body in resources.items():
        kind, name = address.split("__")
        out["resource"].setdefault(kind, {})[name] = {"//": {"metadata": {}}, **body}
    return out


def _group(**kw) -> dict:
    return {"name": "x-group", "zone": "us-central1-a", "target_size": 1,
            "stateful_disk": [{"device_name": review.CHECKPOINT_DEVICE,
                               "delete_rule": "ON_PERMANENT_INSTANCE_DELETION"}], **kw}


def _template(size: int, machine: str = "n1-standard-8") -> dict:
    return {"machine_type": machine, "disk": [
        {"boot": True, "disk_size_gb": 200},
        {"device_name": review.CHECKPOINT_DEVICE, "disk_size_gb": size, "disk_type": "pd-ssd"}]}


def test_group_zone_change_replaces_the_group():
    d = review.diff_stack("x", _stack(**{f"{GROUP}__g": _group()}),
                          _stack(**{f"{GROUP}__g": _group(zone="us-central1-b")}))
    assert len(d.flags) == 1 and d.flags[0].startswith(f"REPLACES the instance group `{GROUP}.g`")
    assert 'zone "us-central1-a" -> "us-central1-b"' in d.flags[0]


def test_zonal_to_regional_replaces_the_group():
    region_group = "google_compute_region_instance_group_manager"
    d = review.diff_stack("x", _stack(**{f"{GROUP}__g": _group()}),
                          _stack(**{f"{region_group}__g": _group()}))
    assert [c.action for c in d.changes] == ["removed", "added"]
    assert len(d.flags) == 1 and d.flags[0].startswith(f"REPLACES the instance group `{GROUP}.g`")


def test_scale_to_zero_and_stateful_policy_flag_the_checkpoint_disk():
    d = review.diff_stack("x", _stack(**{f"{GROUP}__g": _group()}),
                          _stack(**{f"{GROUP}__g": _group(target_size=0)}))
    assert d.flags == [f"DELETES the checkpoint disk: `{GROUP}.g` scales to 0 (target_size 1 -> "
                       "0); the VM and its disk go, the bucket keeps the checkpoints"]
    d = review.diff_stack("x", _stack(**{f"{GROUP}__g": _group()}),
                          _stack(**{f"{GROUP}__g": _group(stateful_disk=[])}))
    assert len(d.flags) == 1 and d.flags[0].startswith("REPLACES the checkpoint disk: the "
                                                       "stateful disk policy")


def test_checkpoint_disk_definition_change_is_flagged_boot_disk_is_not():
    d = review.diff_stack("x", _stack(**{f"{TEMPLATE}__t": _template(300)}),
                          _stack(**{f"{TEMPLATE}__t": _template(500)}))
    assert len(d.flags) == 1
    assert "CHANGES the checkpoint disk definition" in d.flags[0]
    assert "disk.disk_size_gb 300 -> 500" in d.flags[0]
    # What the edit does to a running experiment, and how to get the space anyway.
    (note,) = [n for n in d.notes if "checkpoint_disk_gb" in n]
    assert "a running VM's disk stays 300 GB" in note
    assert "gcloud compute disks resize DISK --size 500 --zone ZONE" in note
    assert "the next boot grows its filesystem" in note
    d = review.diff_stack("x", _stack(**{f"{TEMPLATE}__t": _template(500)}),
                          _stack(**{f"{TEMPLATE}__t": _template(300)}))
    (note,) = [n for n in d.notes if "checkpoint_disk_gb" in n]
    assert "disks cannot shrink; a running VM keeps its 500 GB disk" in note
    boot = _template(300)
    boot["disk"][0]["disk_size_gb"] = 100
    d = review.diff_stack("x", _stack(**{f"{TEMPLATE}__t": _template(300)}),
                          _stack(**{f"{TEMPLATE}__t": boot}))
    assert d.flags == [] and [x.path for x in d.changes[0].attrs] == ["disk[0].disk_size_gb"]


def test_bucket_in_place_change_is_not_flagged_removal_is():
    bucket = {"name": "b", "location": "US", "force_destroy": False}
    d = review.diff_stack("x", _stack(google_storage_bucket__b=bucket),
                          _stack(google_storage_bucket__b={**bucket, "force_destroy": True}))
    assert d.flags == [] and d.status == "changed"
    d = review.diff_stack("x", _stack(google_storage_bucket__b=bucket), None)
    assert d.status == "removed" and d.flags[0].startswith("DESTROYS the bucket")


def test_a_pools_coordinator_disk_and_recreation_are_flagged():
    disk = {"name": "x-coordinator-ckpt", "zone": "us-central1-a", "type": "pd-ssd", "size": 300}
    d = review.diff_stack("x", _stack(google_compute_disk__c=disk),
                          _stack(google_compute_disk__c={**disk, "size": 500}))
    assert d.flags == [] and d.status == "changed"  # grows in place
    assert any("grows in place, 300 -> 500 GB; its filesystem grows at the coordinator's next "
               "boot" in n for n in d.notes), d.notes
    d = review.diff_stack("x", _stack(google_compute_disk__c=disk),
                          _stack(google_compute_disk__c={**disk, "size": 200}))
    assert len(d.flags) == 1  # the provider replaces a disk it is asked to shrink
    assert d.flags[0].startswith("REPLACES the coordinator's checkpoint disk")
    d = review.diff_stack("x", _stack(google_compute_disk__c=disk),
                          _stack(google_compute_disk__c={**disk, "zone": "us-central1-b"}))
    assert len(d.flags) == 1
    assert d.flags[0].startswith("REPLACES the coordinator's checkpoint disk")
    d = review.diff_stack("x", _stack(google_compute_disk__c=disk), _stack())
    assert d.flags[0].startswith("DESTROYS the coordinator's checkpoint disk")
    vm = {"name": "x-coordinator", "metadata_startup_script": "a", "desired_status": "RUNNING"}
    d = review.diff_stack("x", _stack(google_compute_instance__v=vm),
                          _stack(google_compute_instance__v={**vm,
                                                             "metadata_startup_script": "b"}))
    assert d.flags == [] and len(d.notes) == 1 and "is recreated" in d.notes[0]
    d = review.diff_stack("x", _stack(google_compute_instance__v=vm),
                          _stack(google_compute_instance__v={**vm,
                                                             "desired_status": "TERMINATED"}))
    assert d.flags == [] and d.notes == []


def test_metadata_is_ignored_and_long_text_is_summarized():
    a = _stack(google_x__y={"script": "a\nb"})
    b = _stack(google_x__y={"script": "a\nb\nc"})
    b["resource"]["google_x"]["y"]["//"] = {"metadata": {"path": "elsewhere"}}
    d = review.diff_stack("x", a, b)
    text = review.render([d], "base", "head")
    assert "  - `script`: (2 lines of text) -> (3 lines of text), 1 line(s) added, 0 removed" \
        in text
    assert review.diff_stack("x", a, a).status == "unchanged"


# --- the workflow's helpers ----------------------------------------------------------------------


@pytest.mark.xdist_group("review")
def test_changed_experiments(fixture_repo, tmp_path):
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(fixture_repo), str(clone))
    shutil.copy(clone / "experiments" / "fixture.toml", clone / "experiments" / "other.toml")
    assert review.changed_experiments(clone, "main") == []
    assert review.changed_experiments(clone, "main~1") == ["fixture"]
    with (clone / "stacks" / "cost.py").open("a") as f:
        f.write("\n# shared code changed\n")
    assert review.changed_experiments(clone, "main") == ["fixture", "other"]
    run = subprocess.run([sys.executable, "-m", "stacks.review", "--changed", "main~1"],
                         cwd=clone, capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout.split()) == (0, ["fixture", "other"])


PLAN = """\
example  Terraform used the selected providers to generate the following execution plan.
example  \x1b[1m  # google_storage_bucket.checkpoints_bucket_47351590\x1b[0m must be replaced
example  -/+ resource "google_storage_bucket" "checkpoints_bucket_47351590" {
example        ~ location                    = "US-CENTRAL1" -> "US-EAST1" # forces replacement
example          name                        = "p-example-ckpt"
example        }
example    # google_compute_instance_template.template_99367075 must be replaced
example  +/- resource "google_compute_instance_template" "template_99367075" {
example        ~ machine_type = "n1-standard-8" -> "n1-standard-16" # forces replacement
example        }
example    # google_compute_instance_group_manager.group_65B1FA0F will be updated in-place
example  Plan: 2 to add, 1 to change, 2 to destroy.
"""


def test_plan_summary(tmp_path):
    (tmp_path / "example.txt").write_text(PLAN)
    (tmp_path / "broken.txt").write_text("Error: could not load credentials\n")
    assert review.summarize_plans(tmp_path).splitlines() == [
        "## spottrain plan (cdktn diff)",
        "",
        "### `broken`",
        "- the diff did not finish; see the workflow log",
        "",
        "### `example`",
        "Plan: 2 to add, 1 to change, 2 to destroy.",
        "- :warning: **`google_storage_bucket.checkpoints_bucket_47351590` must be replaced**",
        "  - `location` forces replacement",
        "- `google_compute_instance_template.template_99367075` must be replaced",
        "  - `machine_type` forces replacement",
        "- `google_compute_instance_group_manager.group_65B1FA0F` will be updated in-place",
        "",
    ]
    empty = tmp_path / "none"
    empty.mkdir()
    assert "No experiment is affected" in review.summarize_plans(empty)


def test_backend_change_is_noted():
    a = _stack(google_x__y={"v": 1})
    b = _stack(google_x__y={"v": 1})
    a["terraform"] = {"backend": {"local": {"path": "x.tfstate"}}}
    b["terraform"] = {"backend": {"gcs": {"bucket": "state", "prefix": "p"}}}
    d = review.diff_stack("x", a, b)
    assert d.status == "changed" and d.changes == [] and d.flags == []
    assert d.notes[0].startswith("the state backend changes (")
    assert "--migrate-state" in review.render([d], "a", "b")


# --- what the running job does (startup scripts rendered for real; no synthesis) ------------------

from stack_support import merged  # noqa: E402

from stacks.boot import boot_props, render  # noqa: E402
from stacks.load import parse  # noqa: E402


def _job_stack(data: dict, name: str = "x") -> dict:
    exp = parse(data, name, f"{name}.toml")
    return _stack(**{f"{TEMPLATE}__t": {"machine_type": exp.machine.machine_type, "metadata": {
        "startup-script": render(boot_props(name, exp)).startup}},
        "google_storage_bucket__b": {"name": "b", "soft_delete_policy": [
            {"retention_duration_seconds": exp.bucket.soft_delete_days * 86400}]}})


def judge(overrides: dict, base: dict | None = None) -> review.StackDiff:
    old = merged(base or {})
    new = merged(overrides, old)
    (d,) = review.diff({"x": _job_stack(old)}, {"x": _job_stack(new)}, {"x": old}, {"x": new})
    return d


def test_a_steps_edit_is_refused_not_saved_and_resumed():
    d = judge({"trainer": {"steps": 30000}})
    assert d.job == "refused"
    assert "the trainer's resume fingerprint changes (steps 20000 -> 30000)" in d.job_lines[0]
    assert "exits 2" in d.job_lines[0]
    assert d.edits == ["`trainer.steps`: 20000 -> 30000: **REFUSED** (in the resume fingerprint)"]
    text = review.render([d], "a", "b")
    assert "saves on shutdown and resumes" not in text and "running job: **REFUSED**" in text


@pytest.mark.parametrize("config, changed", [
    ({"batch_size": 32}, "batch_size 16 -> 32"),
    ({"task_args": {"n_layer": 3}}, 'task_args {} -> {"n_layer": 3}'),
    ({"precision": "bf16"}, 'precision "fp32" -> "bf16"'),
    ({"seed": 7}, "seed 0 -> 7"),
])
def test_fingerprint_settings_in_trainer_config_are_refused(config, changed):
    d = judge({"trainer": {"config": config}})
    assert d.job == "refused" and f"({changed})" in d.job_lines[0]
    key = next(iter(config))
    assert d.edits[0].startswith(f"`trainer.config.{key}")
    assert d.edits[0].endswith("**REFUSED** (in the resume fingerprint)")


def test_a_flag_in_args_that_changes_the_fingerprint_is_refused():
    d = judge({"trainer": {"args": ["--checkpoint-every-steps", "500", "--seed", "5"]}})
    assert d.job == "refused" and "(seed 0 -> 5)" in d.job_lines[0]
    assert d.edits[0].endswith("**REFUSED** (the flags change the resume fingerprint)")


def test_settings_outside_the_fingerprint_restart_the_vm():
    d = judge({"trainer": {"config": {"log_every_steps": 4, "keep": 5}}})
    assert d.job == "restarts"
    assert d.job_lines[0].startswith("running job: **RESTARTS** (new VM, same checkpoint)")
    assert d.job_lines[1] == "trainer settings outside the fingerprint change: keep 3 -> 5, log_every_steps 10 -> 4"
    assert d.edits == [
        "`trainer.config.keep`: (none) -> 5: restarts with the change as a whole (new VM, same checkpoint)",
        "`trainer.config.log_every_steps`: (none) -> 4: restarts with the change as a whole (new VM, same "
        "checkpoint)"]


def test_other_cpu_threads_change_the_numbers_and_are_refused():
    d = judge({"trainer": {"config": {"threads": 4}}})
    assert d.job == "refused" and "(threads 1 -> 4)" in d.job_lines[0]


def test_the_device_is_compared_as_the_vm_resolves_it():
    """On a GPU machine "auto" is "cuda": spelling it out restarts the VM and resumes; "cpu" is
    another device, which the trainer's fingerprint refuses."""
    d = judge({"trainer": {"config": {"device": "cuda"}}})
    assert d.job == "restarts"
    d = judge({"trainer": {"config": {"device": "cpu"}}})
    assert d.job == "refused" and '(device "cuda" -> "cpu")' in d.job_lines[0]


def test_a_machine_edit_restarts_and_a_bucket_edit_resumes():
    d = judge({"machine": {"machine_type": "g2-standard-12"}})
    assert d.job == "restarts" and d.edits[0].startswith('`machine.machine_type`: "g2-standard-8" ->')
    d = judge({"bucket": {"soft_delete_days": 14}})
    assert d.job == "resumes"
    assert d.edits == ["`bucket.soft_delete_days`: 7 -> 14: resumes (the running VM is untouched)"]


def test_a_two_gpu_machine_restarts_without_refusal():
    """The world size is not in the fingerprint: one VM going from 1 to 2 ranks resumes."""
    base = {"machine": {"machine_type": "n1-standard-8", "gpu_type": "nvidia-tesla-t4", "gpu_count": 1}}
    d = judge({"machine": {"gpu_count": 2}}, base)
    assert d.job == "restarts"


def test_trainer_settings_are_read_back_as_the_vm_reads_them():
    data = merged({"trainer": {"config": {"batch_size": 4, "tiers": {"gcs": {"keep": 2}}},
                               "args": ["--seed=3"]}})
    cfg = review.trainer_settings(_job_stack(data))
    assert (cfg.steps, cfg.batch_size, cfg.seed, cfg.tiers["gcs"].keep) == (20000, 4, 3, 2)
    assert cfg.gcs_uri == "gs://my-project-123456-x-ckpt/runs/x"
    assert review.trainer_settings(_stack()) is None


@pytest.mark.skipif("extend_steps" not in __import__("trainer.config").config.RunConfig.model_fields,
                    reason="the trainer has no explicit steps extension yet (own-job-trainer)")
def test_a_steps_edit_with_extend_steps_continues_the_run():
    d = judge({"trainer": {"steps": 30000, "config": {"extend_steps": True}}})
    assert d.job == "restarts", d.job_lines
    assert any(line.startswith("steps 20000 -> 30000 with extend_steps") for line in d.job_lines)
    assert "`trainer.steps`: 20000 -> 30000: extends the run (extend_steps)" in d.edits
    d = judge({"trainer": {"steps": 30000}})
    assert "set `extend_steps = true` in `[trainer.config]`" in d.job_lines[0]
