"""Reading experiment files: TOML errors, unknown keys, discovery and the override variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from stack_support import EXAMPLE, FIXTURES

from stacks.load import ENV_VAR, ExperimentError, discover, load_all, load_file


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_toml_syntax_error_names_the_line(tmp_path):
    bad = write(tmp_path / "bad.toml", '[gcp]\nproject = "p"\nregion = us-central1\n')
    with pytest.raises(ExperimentError) as info:
        load_file(bad)
    (line,) = info.value.lines
    assert line.startswith(f"{bad}: TOML syntax error: ")
    assert "line 3" in line


def test_unknown_key_in_a_file(tmp_path):
    text = EXAMPLE.read_text().replace("[disk]\n", "[disk]\nsize_gb = 10\n")
    with pytest.raises(ExperimentError) as info:
        load_file(write(tmp_path / "typo.toml", text))
    assert info.value.lines == [
        f"{tmp_path / 'typo.toml'}: disk.size_gb: unknown key; allowed: checkpoint_disk_gb, "
        "local_ssd_count"
    ]


def test_section_of_the_wrong_type():
    from stack_support import merged

    from stacks.load import parse

    with pytest.raises(ExperimentError) as info:
        parse(merged({"group": "big"}), "x", "x.toml")
    assert info.value.lines == [
        "x.toml: group: Input should be a valid dictionary or instance of Group, got 'big'"
    ]


def test_discover_file_folder_and_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(EXAMPLE.parent.parent)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert discover() == sorted(EXAMPLE.parent.glob("*.toml")) and EXAMPLE in discover()
    monkeypatch.setenv(ENV_VAR, str(FIXTURES))
    assert [p.name for p in discover()] == ["a3-regional.toml", "l4-pool.toml",
                                            "n1-v100-standard.toml"]
    monkeypatch.setenv(ENV_VAR, str(FIXTURES / "a3-regional.toml"))
    assert [p.name for p in discover()] == ["a3-regional.toml"]
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(ExperimentError, match="no such experiment file or folder"):
        discover()
    with pytest.raises(ExperimentError, match="no \\*.toml experiment files"):
        discover(tmp_path)


def test_every_file_problem_is_reported_across_files(tmp_path):
    write(tmp_path / "one.toml", "[gcp\n")
    write(tmp_path / "two.toml", EXAMPLE.read_text().replace("steps = 20000", "steps = 0"))
    write(tmp_path / "three.toml", EXAMPLE.read_text())
    with pytest.raises(ExperimentError) as info:
        load_all(tmp_path)
    assert len(info.value.lines) == 2
    assert "one.toml: TOML syntax error" in info.value.lines[0]
    assert info.value.lines[1].endswith(
        "two.toml: trainer.steps: Input should be greater than or equal to 1, got 0")


def test_fixture_experiments_are_valid():
    loaded = load_all(FIXTURES)
    assert [e.name for e in loaded] == ["a3-regional", "l4-pool", "n1-v100-standard"]
    assert loaded[0].spec.group.placement == "regional"
    assert loaded[1].spec.pool is not None and loaded[1].spec.pool.max_nodes == 4
    assert loaded[2].spec.network.mode == "existing"
