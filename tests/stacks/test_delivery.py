"""Code delivery: deterministic archives named by their hash, and what a code change does to the
synthesized stack (a new object and a new template) or does not (nothing at all)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from stack_support import variant

from stacks import delivery
from stacks.delivery import DeliveryError, archive_bytes, build_archive, trainer_archive, user_archive

pytestmark = pytest.mark.xdist_group("stacks")


def tree(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "sub" / "mod.py").write_text("X = 1\n")
    (root / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    (root / "pkg" / "run.sh").chmod(0o755)
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (root / "pkg" / "stale.pyc").write_bytes(b"\0")
    (root / "pkg" / "tests").mkdir()
    (root / "pkg" / "tests" / "test_x.py").write_text("")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    (root / ".env").write_text("SECRET=1")
    return root


def members(data: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return tar.getmembers()


def test_archive_is_byte_identical_for_the_same_tree(tmp_path):
    a = tree(tmp_path / "a")
    first = archive_bytes(a)
    os.utime(a / "pkg" / "sub" / "mod.py", (1, 1))  # a touch is not a change
    b = tmp_path / "b"
    shutil.copytree(a, b)  # another place, other inode order and times
    assert archive_bytes(a) == first == archive_bytes(b)


def test_archive_ships_sources_only_with_fixed_metadata(tmp_path):
    data = archive_bytes(tree(tmp_path / "t"), prefix="top")
    infos = members(data)
    assert [m.name for m in infos] == ["top", "top/pkg", "top/pkg/__init__.py", "top/pkg/run.sh",
                                       "top/pkg/sub", "top/pkg/sub/mod.py"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in infos} == {(0, 0, 0, "", "")}
    modes = {m.name: m.mode for m in infos}
    assert modes["top/pkg/run.sh"] == 0o755 and modes["top/pkg/sub/mod.py"] == 0o644
    # gzip header: MTIME bytes 4-8 are zero, no file name flag.
    assert data[4:8] == b"\0\0\0\0" and not data[3] & 0x08
    assert gzip.decompress(data)  # a valid stream


def test_one_byte_changes_the_name(tmp_path):
    src = tree(tmp_path / "t")
    before = build_archive(src, "user", prefix="", out_dir=tmp_path / "out")
    (src / "pkg" / "sub" / "mod.py").write_text("X = 2\n")
    after = build_archive(src, "user", prefix="", out_dir=tmp_path / "out")
    assert before.release.object_name != after.release.object_name
    for a in (before, after):
        assert a.release.sha256 == hashlib.sha256(a.path.read_bytes()).hexdigest()
        assert a.release.object_name == f"code/user-{a.release.sha256[:16]}.tar.gz"
        assert a.path.name == a.release.object_name.removeprefix("code/")


def test_trainer_archive_unpacks_to_an_importable_package(tmp_path):
    archive = trainer_archive(out_dir=tmp_path)
    names = [m.name for m in members(archive.path.read_bytes())]
    assert "trainer/__main__.py" in names and "trainer/data/corpus.txt" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert all(n == "trainer" or n.startswith("trainer/") for n in names)


def test_missing_code_dir_is_refused(tmp_path):
    with pytest.raises(DeliveryError, match="nope: not a directory"):
        user_archive(tmp_path / "nope", out_dir=tmp_path)


#: What the index served for Python 3.10 on 2026-11-26: ustar's name field holds 100 characters.
LONG_WHEEL = "charset_normalizer-3.5.3-cp310-cp310-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl"


def test_a_wheel_name_over_100_characters_is_packed_deterministically_and_unpacks(tmp_path):
    assert len(LONG_WHEEL) == 101
    a = tmp_path / "a"
    a.mkdir()
    (a / LONG_WHEEL).write_bytes(b"PK wheel bytes")
    (a / "short-1.0-py3-none-any.whl").write_bytes(b"PK short")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    os.utime(b / LONG_WHEEL, (12345, 12345))
    data = archive_bytes(a)
    assert archive_bytes(b) == data  # another place, another mtime: the same bytes
    assert [m.name for m in members(data)] == [LONG_WHEEL, "short-1.0-py3-none-any.whl"]
    # The long name's pax header carries its path and nothing else (no times, no owners), and
    # is itself a fixed ustar header; the short name needs none (packed exactly as ustar).
    raw = gzip.decompress(data)
    header = tarfile.TarInfo.frombuf(raw[:512], "utf-8", "surrogateescape")
    assert header.type == tarfile.XHDTYPE
    assert (header.mtime, header.uid, header.gid, header.uname, header.gname) == (0, 0, 0, "", "")
    records = raw[512:512 + header.size]
    assert records == f"{len(LONG_WHEEL) + 10} path={LONG_WHEEL}\n".encode()
    assert raw.count(b"PaxHeader") == 1
    # GNU tar on the VM unpacks it under its full name.
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "w.tar.gz").write_bytes(data)
    subprocess.run(["tar", "-xzf", str(tmp_path / "w.tar.gz"), "-C", str(out)], check=True)
    assert sorted(p.name for p in out.iterdir()) == [LONG_WHEEL, "short-1.0-py3-none-any.whl"]
    assert (out / LONG_WHEEL).read_bytes() == b"PK wheel bytes"


def test_short_names_pack_as_ustar_would(tmp_path):
    """pax only where ustar cannot: an archive of short names keeps its bytes (and so its
    object name: no roll) from before the format changed."""
    src = tree(tmp_path / "t")
    entries = delivery._entries(src)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, path in entries:
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                data = path.read_bytes()
                info.size, info.mode = len(data), 0o755 if os.access(path, os.X_OK) else 0o644
                tar.addfile(info, io.BytesIO(data))
    assert gzip.decompress(archive_bytes(src)) == raw.getvalue()


def synth(name: str, overrides: dict | None = None) -> str:
    from cdktn import Testing

    from stacks.stack import TrainingStack

    return Testing.synth(TrainingStack(Testing.app(), name, variant(overrides or {}, name)))


def template_and_objects(text: str) -> tuple[dict, dict]:
    data = json.loads(text)["resource"]
    (template,) = data["google_compute_instance_template"].values()
    return template, data["google_storage_bucket_object"]


def test_two_syntheses_are_identical():
    assert synth("example") == synth("example")


def test_a_one_byte_trainer_change_rolls_the_template(tmp_path, monkeypatch):
    before = synth("example")
    copy = tmp_path / "trainer"
    shutil.copytree(delivery.TRAINER_SOURCE, copy,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    with open(copy / "__init__.py", "a") as f:
        f.write("\n")
    monkeypatch.setattr(delivery, "TRAINER_SOURCE", copy)
    after = synth("example")

    (t1, o1), (t2, o2) = template_and_objects(before), template_and_objects(after)
    (obj1,), (obj2,) = ([o for o in objs.values() if o["name"].startswith("code/trainer-")]
                        for objs in (o1, o2))
    assert obj1["name"] != obj2["name"] and obj1["source"] != obj2["source"]
    assert obj1["name"].startswith("code/trainer-") and obj2["name"].startswith("code/trainer-")
    old_sha = obj1["source"].split("/")[2]
    new_sha = obj2["source"].split("/")[2]
    assert old_sha in t1["metadata"]["startup-script"]
    assert new_sha in t2["metadata"]["startup-script"]
    assert old_sha not in t2["metadata"]["startup-script"]
    assert new_sha in t2["metadata"]["startup-script"]
    # Nothing else in the stack moved, but for the bad-input stop marker, which is named by the
    # startup script's digest (new code may be the fix: trainer.cloud.scale).
    from trainer.cloud.scale import digest

    d1, d2 = digest(t1["metadata"]["startup-script"]), digest(t2["metadata"]["startup-script"])
    assert d1 != d2
    assert after.replace(new_sha, old_sha).replace(new_sha[:16], old_sha[:16]).replace(d2, d1) == before


def test_user_code_dir_is_shipped_next_to_the_trainer(tmp_path, monkeypatch):
    code = tmp_path / "mycode"
    (code / "mymodel").mkdir(parents=True)
    (code / "mymodel" / "__init__.py").write_text("")
    (code / "mymodel" / "task.py").write_text("def build(ctx):\n    raise NotImplementedError\n")
    template, objects = template_and_objects(synth("example", {"trainer": {
        "code_dir": str(code), "task": "mymodel.task:build"}}))
    names = sorted(o["name"] for o in objects.values())
    assert [n.split("-")[0] for n in names] == ["code/trainer", "code/user", "code/wheels"]
    user_sha = next(o["source"].split("/")[2] for o in objects.values()
                    if o["name"].startswith("code/user-"))
    assert f"/opt/spottrain/releases/{user_sha}" in template["metadata"]["startup-script"]
    # The code objects, besides the project's APIs that every resource waits for.
    assert sorted(d for d in template["depends_on"]
                  if not d.startswith("google_project_service.")) == sorted(
        f"google_storage_bucket_object.{key}" for key in objects)


def test_a_hostile_code_dir_path_never_reaches_a_script(tmp_path):
    """Only the archive's hash reaches the VM; the path of the user's directory does not."""
    code = tmp_path / "evil $(touch pwned); '\" `id` dir"
    code.mkdir()
    (code / "m.py").write_text("")
    data = json.loads(synth("example", {"trainer": {
        "code_dir": str(code), "args": ["$(touch pwned)", "; rm -rf /", "'\"'"]}}))
    (template,) = data["resource"]["google_compute_instance_template"].values()
    for value in template["metadata"].values():
        assert "evil" not in value and str(tmp_path) not in value
    assert not (tmp_path / "pwned").exists()


def test_state_output_reads_the_guest_attribute_the_scripts_write(example):
    state = example.json["output"]["state_command"]["value"]
    assert state == ("gcloud compute instances get-guest-attributes INSTANCE --project "
                     "my-project-123456 --zone us-central1-a --query-path=spottrain/state")
    (template,) = example.json["resource"]["google_compute_instance_template"].values()
    assert template["metadata"]["enable-guest-attributes"] == "TRUE"
    assert "/instance/guest-attributes/spottrain/state" in template["metadata"]["startup-script"]
