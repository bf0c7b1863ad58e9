"""trainer.checkpoint.key: where the key comes from, locally and from Secret Manager on a VM
(against the loopback fake that speaks Secret Manager's REST protocol)."""
from __future__ import annotations

import base64
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from drill.fake_gcp import FakeGcp
from trainer.checkpoint import key as ck
from trainer.cloud.gce import ApiError, Client

SECRET_ID = "exp-checkpoint-key"


def test_an_explicit_key_file_must_exist_and_hold_a_key(tmp_path: Path) -> None:
    with pytest.raises(ck.KeyProblem, match=r"checkpoint_key_file: cannot read .*nope\.key"):
        ck.resolve(tmp_path / "nope.key", create_default=True)
    assert not (tmp_path / "nope.key").exists()  # a typo never starts a second key
    (tmp_path / "short.key").write_bytes(b"x" * 31)
    with pytest.raises(ck.KeyProblem, match=r"short\.key holds 31 bytes; a checkpoint key is 32 to 4096"):
        ck.load(tmp_path / "short.key")
    (tmp_path / "ok.key").write_bytes(b"y" * 32)
    key = ck.resolve(tmp_path / "ok.key", create_default=False)
    assert key is not None and key.secret == b"y" * 32 and len(key.id) == 16
    assert key.verify(b"data", key.sign(b"data")) and not key.verify(b"data", ck.CheckpointKey(b"z" * 32).sign(b"data"))
    assert "yyyy" not in repr(key)


def test_the_per_user_default_is_created_once_0600_and_only_by_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(ck.ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert ck.resolve(None, create_default=False) is None  # `status` never creates one
    keys: list[Any] = []
    threads = [threading.Thread(target=lambda: keys.append(ck.resolve(None, create_default=True))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = tmp_path / "config" / "spottrain" / "checkpoint.key"
    assert len({k.secret for k in keys}) == 1 and keys[0].source == str(path)  # racing creators agree
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_bytes()) == 32
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.key"]
    monkeypatch.setenv(ck.ENV, str(path))
    assert ck.resolve(None, create_default=False).secret == keys[0].secret


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeGcp, str]]:
    with FakeGcp("proj") as fake:
        monkeypatch.setenv(ck.SECRETMANAGER_ENV, fake.secretmanager_api)
        yield fake, fake.add_secret(SECRET_ID)


def client(fake: FakeGcp) -> Client:
    return Client(token=lambda: (fake.token, 3600.0), sleep=lambda s: None)


def test_the_first_vm_creates_version_1_and_every_vm_reads_it(secrets, tmp_path: Path) -> None:
    fake, name = secrets
    first = ck.fetch(name, tmp_path / "run" / "a.key", client=client(fake), say=lambda m: None)
    assert len(fake.secret_versions(name)) == 1 and fake.secret_versions(name)[0]["data"] == first.secret
    assert stat.S_IMODE((tmp_path / "run" / "a.key").stat().st_mode) == 0o600
    second = ck.fetch(name, tmp_path / "run" / "b.key", client=client(fake), say=lambda m: None)
    assert second.secret == first.secret and len(fake.secret_versions(name)) == 1
    assert ck.load(tmp_path / "run" / "b.key").id == first.id


def test_racing_first_boots_converge_on_version_1(secrets, tmp_path: Path) -> None:
    fake, name = secrets

    class Racer(Client):
        """Another VM adds its key between our look (no version) and our add."""

        def request(self, method: str, url: str, **kw: Any) -> Any:
            if method == "POST" and len(fake.secret_versions(name)) == 0:
                super().request("POST", url, body={"payload": {"data": base64.b64encode(b"r" * 32).decode()}})
            return super().request(method, url, **kw)

    key = ck.fetch(name, tmp_path / "k", client=Racer(token=lambda: (fake.token, 3600.0)), say=lambda m: None)
    assert key.secret == b"r" * 32  # the other VM's version 1, not our own version 2
    assert [v["data"] for v in fake.secret_versions(name)][0] == b"r" * 32 and len(fake.secret_versions(name)) == 2


def test_a_403_is_retried_while_the_grant_propagates_then_fails_clearly(secrets, tmp_path: Path) -> None:
    fake, name = secrets
    fake.deny("GET", r":access$", times=2)
    said: list[str] = []
    ck.fetch(name, tmp_path / "k", client=client(fake), say=said.append, sleep=lambda s: None)
    assert sum("HTTP 403" in m for m in said) == 2 and (tmp_path / "k").exists()
    fake.deny("GET", r":access$")
    with pytest.raises(ApiError, match="403"):
        ck.fetch(name, tmp_path / "k2", client=client(fake), say=said.append, sleep=lambda s: None,
                 forbidden_retry_s=0)
    assert not (tmp_path / "k2").exists()


def test_a_disabled_key_is_an_error_and_no_new_key_is_made(secrets, tmp_path: Path) -> None:
    fake, name = secrets
    ck.fetch(name, tmp_path / "k", client=client(fake), say=lambda m: None)
    fake.secrets[name][0]["state"] = "DESTROYED"
    with pytest.raises(ApiError, match="FAILED_PRECONDITION"):
        ck.fetch(name, tmp_path / "k2", client=client(fake), say=lambda m: None)
    assert len(fake.secret_versions(name)) == 1
    with pytest.raises(ck.KeyProblem, match="does not exist: deploy the stack"):
        ck.fetch(name.replace(SECRET_ID, "missing"), tmp_path / "k3", client=client(fake), say=lambda m: None)


def test_the_command_line_the_boot_runs(secrets, tmp_path: Path, monkeypatch, capsys) -> None:
    from drill.metadata_server import MetadataServer

    fake, name = secrets
    fake.token = "drill-fake-token"  # what the fake metadata server hands out
    with MetadataServer() as md:
        monkeypatch.setenv("GCE_METADATA_HOST", md.host)
        assert ck.main(["fetch", "--secret", name, "--out", str(tmp_path / "k")]) == 0
    assert ck.load(tmp_path / "k").secret == fake.secret_versions(name)[0]["data"]
    assert "spottrain-key: checkpoint key (id" in capsys.readouterr().out


def test_a_key_path_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    fifo = tmp_path / "checkpoint.key"
    os.mkfifo(fifo)  # no writer ever opens it: reading would wait forever
    answer: list[BaseException] = []

    def load() -> None:
        try:
            ck.load(fifo)
        except BaseException as e:  # noqa: BLE001 (handed to the test's thread)
            answer.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(60.0)  # a failure guard only: a refusal takes no time, a hang never returns
    assert not t.is_alive(), "loading a FIFO as the key hangs"
    assert len(answer) == 1 and isinstance(answer[0], ck.KeyProblem)
    assert re.search(r"checkpoint_key_file: \S*checkpoint\.key is not a regular file \(a FIFO\)", str(answer[0]))
    with pytest.raises(ck.KeyProblem, match=r"is not a regular file \(a directory\)"):
        ck.load(tmp_path)
    with pytest.raises(ck.KeyProblem, match=r"is not a regular file \(a character device\)"):
        ck.load(Path("/dev/zero"))
