"""The fake metadata server speaks the GCE protocol to real clients (curl, urllib, google-auth)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from drill.metadata_server import MetadataServer

GOOGLE = {"Metadata-Flavor": "Google"}


def get(server: MetadataServer, path: str, headers: dict[str, str] | None = GOOGLE, method: str = "GET",
        data: bytes | None = None) -> tuple[int, str, dict[str, str]]:
    req = urllib.request.Request(server.url + path, headers=headers or {}, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def test_requests_without_the_flavor_header_are_refused(metadata: MetadataServer) -> None:
    status, body, headers = get(metadata, "instance/preempted", headers={})
    assert status == 403 and "Metadata-Flavor" in body
    assert headers["Metadata-Flavor"] == "Google"
    status, _, _ = get(metadata, "instance/preempted", headers={**GOOGLE, "X-Forwarded-For": "1.2.3.4"})
    assert status == 403


def test_answers_echo_the_flavor_header_and_carry_an_etag(metadata: MetadataServer) -> None:
    status, body, headers = get(metadata, "instance/preempted")
    assert (status, body) == (200, "FALSE")
    assert headers["Metadata-Flavor"] == "Google" and headers["ETag"]


def test_wait_for_change_blocks_until_preempt(metadata: MetadataServer) -> None:
    answers: list[str] = []
    done = threading.Event()

    def watch() -> None:
        answers.append(get(metadata, "instance/preempted?wait_for_change=true")[1])
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    assert metadata.wait_waiters(1, timeout=30), "the request never reached the server"
    assert not done.is_set() and answers == []   # blocked inside the server, no answer yet
    metadata.preempt()
    assert done.wait(timeout=30)
    assert answers == ["TRUE"]
    assert get(metadata, "instance/preempted")[1] == "TRUE"


def test_wait_for_change_with_a_stale_etag_answers_at_once(metadata: MetadataServer) -> None:
    _, _, headers = get(metadata, "instance/preempted")
    metadata.preempt()
    status, body, _ = get(metadata, f"instance/preempted?wait_for_change=true&last_etag={headers['ETag']}")
    assert (status, body) == (200, "TRUE")


def test_wait_for_change_times_out_with_the_unchanged_value(metadata: MetadataServer) -> None:
    assert get(metadata, "instance/preempted?wait_for_change=true&timeout_sec=0.2")[1] == "FALSE"


def test_reset_is_a_fresh_vm(metadata: MetadataServer) -> None:
    metadata.preempt()
    get(metadata, "instance/guest-attributes/spottrain/state", method="PUT", data=b"finished")
    metadata.reset()
    assert get(metadata, "instance/preempted")[1] == "FALSE"
    assert get(metadata, "instance/guest-attributes/spottrain/state")[0] == 404


def test_attributes_and_guest_attributes(metadata: MetadataServer) -> None:
    assert get(metadata, "instance/attributes/answer")[1] == "42"
    assert get(metadata, "instance/attributes/missing")[0] == 404
    assert '"answer": "42"' in get(metadata, "instance/attributes/?recursive=true")[1]
    assert get(metadata, "instance/guest-attributes/spottrain/state", method="PUT", data=b"finished")[0] == 200
    assert get(metadata, "instance/guest-attributes/spottrain/state")[1] == "finished"
    assert metadata.guest_attributes() == {"spottrain/state": "finished"}
    assert metadata.wait_guest_attribute("spottrain/state", timeout=1) == "finished"
    assert get(metadata, "instance/attributes/answer", method="PUT", data=b"x")[0] == 405


def test_curl_as_the_boot_scripts_use_it(metadata: MetadataServer) -> None:
    out = subprocess.run(
        ["bash", "-c", 'curl -fsS -H "Metadata-Flavor: Google" '
                       '"http://${GCE_METADATA_HOST:-metadata.google.internal}/computeMetadata/v1/instance/preempted"'],
        env={**os.environ, "GCE_METADATA_HOST": metadata.host}, capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (0, "FALSE")


def test_google_auth_finds_it_through_gce_metadata_host(metadata: MetadataServer) -> None:
    pytest.importorskip("google.auth")
    code = ("import google.auth.transport.requests as t, google.auth.compute_engine._metadata as m;"
            "print(m.ping(t.Request()), m.get_project_id(t.Request()))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "GCE_METADATA_HOST": metadata.host, "GCE_METADATA_IP": metadata.host},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "spottrain-drill"], out.stderr


def test_requests_are_recorded_with_their_flavor_header(metadata: MetadataServer) -> None:
    get(metadata, "instance/preempted")
    get(metadata, "instance/preempted", headers={})
    assert [(r.method, r.path, r.flavor) for r in metadata.requests] == [
        ("GET", "/computeMetadata/v1/instance/preempted", "Google"),
        ("GET", "/computeMetadata/v1/instance/preempted", None)]


def test_etag_is_what_a_get_answers(metadata: MetadataServer) -> None:
    assert get(metadata, "instance/preempted")[2]["ETag"] == metadata.etag("instance/preempted")
    before = metadata.etag("instance/preempted")
    metadata.preempt()
    assert metadata.etag("instance/preempted") != before


def test_restart_is_an_outage_on_the_same_port(metadata: MetadataServer) -> None:
    """stop() releases waiters and cuts keep-alive connections; start() listens on the same port
    with the values kept."""
    import http.client

    port = metadata.port
    get(metadata, "instance/guest-attributes/spottrain/state", method="PUT", data=b"training")
    released = threading.Event()

    def watch() -> None:
        try:
            get(metadata, "instance/preempted?wait_for_change=true")
        except (OSError, http.client.HTTPException):
            # The connection was cut, maybe in the middle of the answer (IncompleteRead is no
            # OSError): as good as an answer for a client that retries.
            pass
        released.set()

    threading.Thread(target=watch, daemon=True).start()
    assert metadata.wait_waiters(1, timeout=30)
    keep_alive = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    keep_alive.request("GET", "/computeMetadata/v1/instance/preempted", headers=GOOGLE)
    assert keep_alive.getresponse().read() == b"FALSE"

    metadata.stop()
    assert released.wait(30) and metadata.waiting == 0
    with pytest.raises(urllib.error.URLError):
        get(metadata, "instance/preempted")

    metadata.preempt()   # the value changes while it is down
    metadata.start()
    assert metadata.port == port
    assert get(metadata, "instance/preempted")[1] == "TRUE"
    assert get(metadata, "instance/guest-attributes/spottrain/state")[1] == "training"
    # A connection from before the outage is gone, as it would be with a new server process.
    with pytest.raises((http.client.HTTPException, OSError)):
        keep_alive.request("GET", "/computeMetadata/v1/instance/preempted", headers=GOOGLE)
        keep_alive.getresponse().read()
    keep_alive.close()
