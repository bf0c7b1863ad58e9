"""`python -m stacks.demo`: what `make demo` prints for the example."""

from __future__ import annotations

import pytest

from stacks import demo

pytestmark = pytest.mark.xdist_group("stacks")


def test_demo_summarizes_the_example(capsys, monkeypatch):
    from stack_support import ROOT

    monkeypatch.chdir(ROOT)
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert "experiments/example.toml -> stack 'example'" in out
    assert "g2-standard-8, GPUs built in, SPOT -> DELETE" in out
    assert "tcp:8471 from 35.191.0.0/16, 130.211.0.0/22" in out
    assert "roles/storage.objectAdmin on the checkpoint bucket" in out
    assert "emergency save: 1.8 MB" in out and ": fits" in out
    assert "scale_to_zero_command" in out
    assert "hourly price      Spot $" in out and "savings" in out and "with Spot" in out
    # The bucket line says what the synthesized bucket keeps, not a fixed word.
    assert "my-project-123456-example-ckpt  US-CENTRAL1, not versioned, soft delete 7 d, " \
           "public access enforced" in out


def test_demo_says_what_a_versioned_bucket_keeps(tmp_path, capsys, monkeypatch):
    from stack_support import ROOT

    monkeypatch.chdir(ROOT)
    text = (ROOT / "experiments/example.toml").read_text()
    for old, new in (("versioning = false", "versioning = true\nnoncurrent_days = 3"),
                     ("soft_delete_days = 7", "soft_delete_days = 0")):
        assert old in text
        text = text.replace(old, new)
    (tmp_path / "kept.toml").write_text(text)
    assert demo.main([str(tmp_path / "kept.toml")]) == 0
    out = capsys.readouterr().out
    assert "US-CENTRAL1, versioned (at most 3 older versions, 3 d), soft delete off, " \
           "public access enforced" in out


def test_demo_bad_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("labels = 3\n")
    assert demo.main([str(bad)]) == 2
    assert "labels: Input should be a valid dictionary" in capsys.readouterr().err


def test_demo_without_a_lock_exits_2_in_one_line(tmp_path, capsys):
    """An experiment whose code_dir names requirements nobody locked: one line saying what to run,
    no traceback (synthesis never resolves dependencies itself)."""
    from stack_support import EXAMPLE

    code = tmp_path / "code"
    code.mkdir()
    (code / "task.py").write_text("")
    (code / "requirements.txt").write_text("numpy>=1.26\n")
    exp = tmp_path / "mine.toml"
    exp.write_text(EXAMPLE.read_text().replace("[trainer]\n", f'[trainer]\ncode_dir = "{code}"\n'))
    assert demo.main([str(exp)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{code}/requirements.py3.10-glibc2.35.lock: no lock of the VM's dependencies for Python "
                   "3.10, glibc 2.35, image torch 2.9.0 (synthesis installs exactly a committed lock, it never "
                   "resolves): run `make lock EXPERIMENT=mine` and commit the lock"]


def test_demo_names_every_resource_it_lists(capsys, monkeypatch):
    """No row of the resource list goes out blank: alert policies, the dashboard, APIs, custom
    roles and the secret are named, and an IAM grant says on what and for whom."""
    from stack_support import ROOT

    monkeypatch.chdir(ROOT)
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    resources = out.split("\n\n")[1].splitlines()  # "  kind (34 wide) summary", one a resource
    assert len(resources) > 40 and all(line[37:].strip() for line in resources), out
    assert "monitoring_alert_policy            spottrain example: training stalled" in out
    assert "project_service                    compute.googleapis.com" in out
    assert "secret_manager_secret              example-checkpoint-key" in out
    assert "roles/secretmanager.secretAccessor on the secret example-checkpoint-key for example-trainer" in out
    assert "monitoring_dashboard               spottrain example" in out
