"""The per-experiment checkpoint key: where it comes from, and the HMAC it puts on manifests.

Every manifest a trainer writes carries an HMAC-SHA256 over its canonical JSON, made with this
key. A reader with the key loads a checkpoint only when that HMAC verifies, so that whoever can
write a checkpoint bucket but does not hold the key cannot make a trainer or ``status`` load
something of their choosing (sharded checkpoints still contain DCP's pickled index: see
docs/security.md for the whole threat model).

Where the key comes from (the first that is set):

1. ``--checkpoint-key-file PATH`` or ``checkpoint_key_file`` in the config file;
2. the environment variable ``SPOTTRAIN_CHECKPOINT_KEY_FILE``;
3. the per-user default ``$XDG_CONFIG_HOME/spottrain/checkpoint.key`` (``~/.config/...``), which
   ``trainer run`` creates (32 random bytes, mode 0600) when it does not exist yet; ``status``
   never creates it.

An explicitly named file must exist: a typo must not silently start a second key. The key is the
file's bytes exactly (at least 32), e.g. what ``gcloud secrets versions access 1 --secret NAME
--out-file PATH`` writes.

On a VM the stack provisions a Secret Manager secret per experiment (``stacks.checkpoint_key``)
and the startup script runs ``python -m trainer.checkpoint.key fetch``: it reads version 1 of
that secret with the VM's own token, and when the secret has no version yet it adds 32 random
bytes and reads version 1 again, so that VMs racing on a first boot converge on one key. The key
lands in a 0600 file on a tmpfs (``/run/spottrain``), never on a disk or in Terraform state.

Standard library only: the boot runs ``fetch`` before anything else of the trainer is needed.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import logging
import os
import stat
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from trainer import manifest_auth, retry
from trainer.cloud import gce

log = logging.getLogger(__name__)

ENV = "SPOTTRAIN_CHECKPOINT_KEY_FILE"
#: Secret Manager's REST endpoint (``trainer.cloud.gce`` owns the names; the control job reads it too).
SECRETMANAGER_ENV = gce.SECRETMANAGER_ENV
DEFAULT_SECRETMANAGER = gce.DEFAULT_SECRETMANAGER
MIN_BYTES = 32
MAX_BYTES = 4096


class KeyProblem(Exception):
    """No usable checkpoint key (missing, unreadable, too short): bad input, exit 2."""


@dataclass(frozen=True)
class CheckpointKey:
    """A checkpoint key and where it came from (``source``, for messages)."""

    secret: bytes = field(repr=False)
    source: str = ""
    #: The run this key signs for (its durable location, ``gs://BUCKET/PREFIX``): written into
    #: every manifest it signs, and a manifest signed for another run is refused (one key serves
    #: every run of an experiment, so an authentic checkpoint could be copied between them).
    #: None: unbound (a run without a bucket, or a reader such as ``status`` or ``init_from``).
    run: str | None = None

    def bound_to(self, run: str | None) -> "CheckpointKey":
        """This key, signing for and accepting only ``run``'s checkpoints (and unbound ones)."""
        return replace(self, run=run)

    @property
    def id(self) -> str:
        """A public name for the key (recorded in manifests): which key signed what, without
        revealing the key."""
        return manifest_auth.key_id(self.secret)

    def sign(self, data: bytes) -> str:
        return manifest_auth.sign(self.secret, data)

    def verify(self, data: bytes, mac: object) -> bool:
        return manifest_auth.verify(self.secret, data, mac)


def default_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "spottrain" / "checkpoint.key"


def load(path: Path) -> CheckpointKey:
    """The key in ``path``; ``KeyProblem`` naming the file when it cannot be used."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever (a hung
        # start-up); the descriptor's own mode is checked before anything is read from it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise KeyProblem(f"checkpoint_key_file: cannot read {path}: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise KeyProblem(f"checkpoint_key_file: {path} is not a regular file ({_kind(mode)}); "
                             f"a checkpoint key is a file of {MIN_BYTES} to {MAX_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise KeyProblem(f"checkpoint_key_file: cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if not MIN_BYTES <= len(data) <= MAX_BYTES:
        raise KeyProblem(f"checkpoint_key_file: {path} holds {len(data)} bytes; a checkpoint key is "
                         f"{MIN_BYTES} to {MAX_BYTES} bytes (e.g. `head -c 32 /dev/urandom > FILE`)")
    if mode & 0o077:
        log.warning("checkpoint key %s is readable by other users (mode %o): chmod 600 it", path, mode & 0o777)
    return CheckpointKey(data, str(path))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def create(path: Path) -> CheckpointKey:
    """A new random key at ``path`` (mode 0600), or the one already there: processes racing to
    create it (the ranks of one job) all end up with the same key."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        return load(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, os.urandom(MIN_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic and exclusive: the first creator wins, the others read it
        log.warning("created a checkpoint key at %s: keep it (checkpoints signed with it resume only "
                    "with it); see docs/security.md", path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return load(path)


def resolve(path: Path | None, *, create_default: bool) -> CheckpointKey | None:
    """The key a command uses (see the module docstring); None only when nothing is configured
    and the default file does not exist and may not be created (``status``)."""
    if path is not None:
        return load(path)
    env = os.environ.get(ENV)
    if env:
        return load(Path(env))
    default = default_path()
    if default.exists():
        return load(default)
    if not create_default:
        return None
    try:
        return create(default)
    except OSError as e:
        raise KeyProblem(f"checkpoint_key_file: none given, and the default {default} cannot be created "
                         f"({e.strerror or e}); pass --checkpoint-key-file") from None


# --------------------------------------------------------------------------------------------
# On a VM: the experiment's Secret Manager secret
# --------------------------------------------------------------------------------------------


def _api() -> str:
    return (os.environ.get(SECRETMANAGER_ENV) or DEFAULT_SECRETMANAGER).rstrip("/")


def fetch(secret: str, out: Path, *, client: Any = None, forbidden_retry_s: float = retry.IAM_GRANT.grace_s,
          first_wait_s: float = retry.IAM_GRANT.grace_first_s, sleep: Callable[[float], None] = time.sleep,
          say: Callable[[str], None] = print, create: bool = True, api: str | None = None) -> CheckpointKey:
    """Read version 1 of ``secret`` (``projects/P/secrets/S``) into ``out`` (0600, written
    atomically); create it first when the secret has no version yet (unless not ``create``: an
    operator's copy, which KeyProblem refuses then). ``api``: the endpoint (default
    ``$SPOTTRAIN_SECRETMANAGER_API``, else Google's).

    A 403 is retried within ``forbidden_retry_s`` of the first call (``trainer.retry``'s grace:
    the VM's grant may still be propagating, up to ~7 minutes); 429/5xx are retried by the
    client. A version 1 that exists but is disabled or destroyed is an error: a new key would not
    authenticate the experiment's checkpoints, so none is made.
    """
    from trainer.cloud.gce import Client

    client = client or Client()
    url = f"{(api or _api()).rstrip('/')}/{secret}"
    # One grace for the whole fetch (read, create, read again); 429/5xx are the client's.
    grant = retry.Retry(dataclasses.replace(retry.IAM_GRANT, grace_s=forbidden_retry_s, grace_first_s=first_wait_s),
                        transient=retry.never, sleep=sleep,
                        on_retry=lambda t: say(f"{secret} answered HTTP 403 (the grant may still be propagating); "
                                               f"retrying in {t.wait_s:.0f} s"))

    def call(method: str, path: str, body: Any = None) -> Any:
        return grant.call(lambda: client.request(method, url + path, body=body, ok404=True), f"{method} {secret}")

    def version1() -> bytes | None:
        answer = call("GET", "/versions/1:access")
        if answer is None:
            return None
        try:
            return base64.b64decode(answer["payload"]["data"], validate=True)
        except (KeyError, TypeError, binascii.Error):
            raise KeyProblem(f"{secret}: version 1 answered without a base64 payload") from None

    data = version1()
    if data is None and not create:
        raise KeyProblem(f"{secret} has no version 1 yet: no VM of this experiment has booted")
    if data is None:
        say(f"{secret} has no version yet: adding a new random key as version 1")
        added = call("POST", ":addVersion",
                     {"payload": {"data": base64.b64encode(os.urandom(MIN_BYTES)).decode()}})
        if added is None:
            raise KeyProblem(f"{secret} does not exist: deploy the stack (it creates the secret)")
        data = version1()  # ours, or the version 1 of a VM that raced us
        if data is None:
            raise KeyProblem(f"{secret}: version 1 is still missing after adding a version")
    if not MIN_BYTES <= len(data) <= MAX_BYTES:
        raise KeyProblem(f"{secret}: version 1 holds {len(data)} bytes, not a checkpoint key "
                         f"({MIN_BYTES} to {MAX_BYTES} bytes)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, out)
    key = CheckpointKey(data, str(out))
    say(f"checkpoint key (id {key.id}) from {secret} version 1 is in {out}")
    return key


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.checkpoint_key",
                                description="Fetch an experiment's checkpoint key from Secret Manager.")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="version 1 of the secret (created when missing) into a 0600 file")
    f.add_argument("--secret", required=True, help="projects/PROJECT/secrets/NAME")
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--forbidden-retry-s", type=float, default=retry.IAM_GRANT.grace_s)
    f.add_argument("--first-wait-s", type=float, default=retry.IAM_GRANT.grace_first_s)
    args = p.parse_args(argv)
    from trainer.cloud.gce import ApiError

    def say(msg: str) -> None:
        print(f"spottrain-key: {msg}", flush=True)

    try:
        fetch(args.secret, args.out, forbidden_retry_s=args.forbidden_retry_s, first_wait_s=args.first_wait_s,
              say=say)
    except (ApiError, KeyProblem, OSError) as e:
        say(f"FAILED: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
