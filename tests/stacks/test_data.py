"""`[data]` in the stack: read on that bucket only, staged by the boot script, --data-dir."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("stacks")


def test_the_vms_may_read_the_data_bucket_and_nothing_more(synthesized):
    data, plain = synthesized["data"], synthesized["example"]
    (account,) = [k for k, a in data.json["resource"]["google_service_account"].items()
                  if a["account_id"].endswith("-trainer")]
    grants = data.resources("google_storage_bucket_iam_member")
    on_data = [g for g in grants if g["bucket"] == "my-datasets"]
    assert [(g["role"], g["member"]) for g in on_data] == [
        ("roles/storage.objectViewer", f"serviceAccount:${{google_service_account.{account}.email}}")]
    # The other grants are the example's own (the checkpoint bucket's): [data] adds exactly one.
    assert len(grants) == len(plain.resources("google_storage_bucket_iam_member")) + 1
    assert not any(r.get("role") == "roles/storage.objectViewer"
                   for kind in ("google_project_iam_member",) for r in data.resources(kind))


def test_the_group_waits_for_the_data_grant(synthesized):
    data = synthesized["data"]
    key = next(k for k, g in data.json["resource"]["google_storage_bucket_iam_member"].items()
               if g["bucket"] == "my-datasets")
    assert f"google_storage_bucket_iam_member.{key}" in data.one("google_compute_instance_group_manager")["depends_on"]


def test_the_startup_script_stages_before_training_and_the_trainer_gets_the_dir(synthesized):
    script = synthesized["data"].one("google_compute_instance_template")["metadata"]["startup-script"]
    assert "readonly DATA_SOURCE=gs://my-datasets/openwebtext" in script
    assert 'trainer stage --from "$DATA_SOURCE" --to "$data_dir"' in script and "--parallel 8" in script
    assert script.index("trainer stage") < script.index("until nvidia-smi") < script.index('systemctl start "$UNIT"')
    assert '--data-dir "${SPOTTRAIN_DATA_DIR:?' in script
    assert "EnvironmentFile=-/etc/spottrain/data.env" in script
    plain = synthesized["example"].one("google_compute_instance_template")["metadata"]["startup-script"]
    assert "trainer stage" not in plain and "--data-dir" not in plain


def test_a_streamed_dataset_is_not_staged_and_the_trainer_gets_its_url(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    from stack_support import variant

    from stacks.boot import boot_props, render

    url = "gs://my-datasets/train/shard-{000000..000099}.tar"
    scripts = render(boot_props("s", variant({"data": {"source": url, "stream": True}}, "s")))
    assert "--data-url 'gs://my-datasets/train/shard-{000000..000099}.tar'" in scripts.trainer_sh
    assert "trainer stage" not in scripts.startup and "--data-dir" not in scripts.trainer_sh
    assert "data.env" not in scripts.unit
    (tmp_path / "trainer.sh").write_text(scripts.trainer_sh)
    (tmp_path / "startup.sh").write_text(scripts.startup)
    check = subprocess.run([str(Path(sys.prefix) / "bin" / "shellcheck"), "--shell=bash", str(tmp_path / "trainer.sh"),
                            str(tmp_path / "startup.sh")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    staged = render(boot_props("s", variant({"data": {"source": url}}, "s")))
    assert "--data-url" not in staged.trainer_sh and "trainer stage" in staged.startup  # the default: staged


def test_a_bad_stream_value_names_the_file_and_field() -> None:
    from stack_support import variant

    from stacks.load import ExperimentError

    with pytest.raises(ExperimentError) as e:
        variant({"data": {"source": "gs://my-datasets/x", "stream": "sometimes"}}, "s")
    assert any(line.startswith("s.toml: data.stream: ") for line in e.value.lines), e.value.lines
