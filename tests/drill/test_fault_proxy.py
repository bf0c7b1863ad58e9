"""The fault proxy itself: each misbehaviour reaches the real client as Cloud Storage would show it."""
from __future__ import annotations

import threading

import pytest
from google.api_core import exceptions as gexc


def _bucket(gcs_proxy, direct: bool = False):
    return gcs_proxy.client(direct=direct).bucket(gcs_proxy.bucket)


def test_requests_pass_through_and_resumable_uploads_stay_on_the_proxy(gcs_proxy) -> None:
    b = _bucket(gcs_proxy)
    b.blob("a/small").upload_from_string(b"x" * 10)
    big = b.blob("a/big")
    big.chunk_size = 4 << 20
    data = b"y" * (9 << 20)  # over 8 MiB: resumable, and its Location must point at the proxy
    big.upload_from_string(data)
    assert _bucket(gcs_proxy, direct=True).blob("a/big").download_as_bytes() == data
    assert sorted(x.name for x in gcs_proxy.client().list_blobs(b, prefix="a/")) == ["a/big", "a/small"]
    assert any("upload_id" in s.path for s in gcs_proxy.proxy.seen("PUT"))


@pytest.mark.parametrize("status, error", [(403, gexc.Forbidden), (429, gexc.TooManyRequests),
                                           (503, gexc.ServiceUnavailable)])
def test_a_status_rule_answers_once_then_lets_requests_through(gcs_proxy, status, error) -> None:
    b = _bucket(gcs_proxy)
    b.blob("k").upload_from_string(b"v")
    gcs_proxy.proxy.add("GET", r"alt=media object=k$", "status", status=status, times=1)
    with pytest.raises(error):
        b.blob("k").download_as_bytes(retry=None)
    assert b.blob("k").download_as_bytes(retry=None) == b"v"


def test_a_stalled_request_is_held_until_released(gcs_proxy) -> None:
    b = _bucket(gcs_proxy)
    rule = gcs_proxy.proxy.add("POST", r"object=held$", "stall")
    done = threading.Event()
    t = threading.Thread(target=lambda: (b.blob("held").upload_from_string(b"1", retry=None), done.set()))
    t.start()
    assert gcs_proxy.proxy.wait_stalled(rule)
    assert not done.is_set() and _bucket(gcs_proxy, direct=True).get_blob("held") is None
    gcs_proxy.proxy.release(rule)
    t.join(30)
    assert done.is_set() and _bucket(gcs_proxy, direct=True).get_blob("held") is not None


def test_a_held_request_whose_client_gave_up_still_lands_once_released(gcs_proxy) -> None:
    """As on the real network: a write the client stopped waiting for can still reach the server,
    and `wait_settled` says when it has."""
    import requests

    b = _bucket(gcs_proxy)
    rule = gcs_proxy.proxy.add("POST", r"object=late$", "stall")
    gave_up: list[BaseException] = []

    def upload() -> None:
        try:
            b.blob("late").upload_from_string(b"1", retry=None, timeout=0.2)
        except requests.exceptions.Timeout as e:
            gave_up.append(e)

    t = threading.Thread(target=upload)
    t.start()
    assert gcs_proxy.proxy.wait_stalled(rule)
    t.join(30)
    assert len(gave_up) == 1 and rule.settled == 0
    assert _bucket(gcs_proxy, direct=True).get_blob("late") is None
    gcs_proxy.proxy.release(rule)
    assert gcs_proxy.proxy.wait_settled(rule)
    assert _bucket(gcs_proxy, direct=True).get_blob("late") is not None


def test_down_refuses_connections_and_up_restores_them(gcs_proxy) -> None:
    import requests

    b = _bucket(gcs_proxy)
    gcs_proxy.proxy.down()
    with pytest.raises(requests.ConnectionError):
        b.blob("x").upload_from_string(b"1", retry=None)
    gcs_proxy.proxy.up()
    b.blob("x").upload_from_string(b"1", retry=None)


def test_after_forward_writes_but_loses_the_answer(gcs_proxy) -> None:
    b = _bucket(gcs_proxy)
    gcs_proxy.proxy.add("POST", r"object=lost$", "after-forward", status=503)
    with pytest.raises(gexc.ServiceUnavailable):
        b.blob("lost").upload_from_string(b"1", retry=None)
    assert _bucket(gcs_proxy, direct=True).blob("lost").download_as_bytes() == b"1"


def test_generation_preconditions_are_enforced(gcs_proxy) -> None:
    b = _bucket(gcs_proxy)
    b.blob("lease").upload_from_string(b"A", if_generation_match=0)
    with pytest.raises(gexc.PreconditionFailed):
        b.blob("lease").upload_from_string(b"B", if_generation_match=0, retry=None)
    gen = b.get_blob("lease").generation
    with pytest.raises(gexc.PreconditionFailed):
        b.blob("lease").upload_from_string(b"C", if_generation_match=gen + 1, retry=None)
    b.blob("lease").upload_from_string(b"D", if_generation_match=gen, retry=None)
    assert b.blob("lease").download_as_bytes() == b"D"
    with pytest.raises(gexc.PreconditionFailed):
        b.blob("lease").delete(if_generation_match=gen, retry=None)  # it moved on
    assert b.get_blob("lease") is not None


def test_a_flipped_download_keeps_its_headers_so_the_client_sees_the_corruption(gcs_proxy) -> None:
    from google.cloud.storage.exceptions import DataCorruption

    b = _bucket(gcs_proxy)
    data = bytes(range(256)) * 64
    b.blob("f").upload_from_string(data)
    gcs_proxy.proxy.add("GET", r"alt=media object=f$", "flip", times=1)
    with pytest.raises(DataCorruption):
        b.blob("f").download_as_bytes(retry=None)
    assert b.blob("f").download_as_bytes(retry=None) == data  # stored intact: the next read is whole


def test_a_flipped_upload_is_refused_by_the_servers_crc32c_check_and_nothing_is_stored(gcs_proxy) -> None:
    """A multipart upload carries the payload's crc32c in its metadata part: Cloud Storage (and
    the emulator) compute it over what arrived and refuse the upload (400) when it differs."""
    b = _bucket(gcs_proxy)
    data = bytes(range(256)) * 64  # the body's middle byte lies in the payload, not the metadata
    gcs_proxy.proxy.add("POST", r"object=u$", "flip-request", times=1)
    with pytest.raises(gexc.BadRequest, match="(?i)crc32c"):
        b.blob("u").upload_from_string(data, retry=None, if_generation_match=0)
    assert _bucket(gcs_proxy, direct=True).get_blob("u") is None
    [seen] = gcs_proxy.proxy.seen("POST", "object=u$")
    assert seen.outcome.startswith("request byte ") and seen.outcome.endswith("flipped, forwarded 400"), seen
    b.blob("u").upload_from_string(data, retry=None, if_generation_match=0)  # the next upload lands whole
    assert _bucket(gcs_proxy, direct=True).blob("u").download_as_bytes() == data


def test_a_flipped_chunk_of_a_resumable_upload_leaves_nothing_corrupt(gcs_proxy) -> None:
    """Over 8 MiB an upload is resumable and its last chunk carries the whole object's crc32c
    (x-goog-hash): Cloud Storage refuses to finish it. The emulator ignores that header and stores
    the bytes; the client then compares the crc32c it reports, deletes the object and raises
    DataCorruption. Either way nothing corrupt stays (RELIABILITY.md says which the matrix runs)."""
    from google.cloud.storage.exceptions import DataCorruption

    blob = _bucket(gcs_proxy).blob("big")
    blob.chunk_size = 4 << 20
    data = bytes(range(256)) * ((9 << 20) // 256)
    gcs_proxy.proxy.add("PUT", r"upload_id=", "flip-request", times=1)
    with pytest.raises(DataCorruption):
        blob.upload_from_string(data, retry=None, if_generation_match=0)
    assert _bucket(gcs_proxy, direct=True).get_blob("big") is None
    assert [s.method for s in gcs_proxy.proxy.seen() if "flipped" in s.outcome] == ["PUT"]


def test_compose_preconditions_are_enforced(gcs_proxy) -> None:
    b = _bucket(gcs_proxy)
    for name, data in (("p0", b"ab"), ("p1", b"cd"), ("whole", b"old")):
        b.blob(name).upload_from_string(data)
    p0, p1 = b.get_blob("p0"), b.get_blob("p1")
    with pytest.raises(gexc.PreconditionFailed):  # create-only, and "whole" exists
        b.blob("whole").compose([p0, p1], if_generation_match=0, retry=None)
    b.blob("p1").upload_from_string(b"XY")  # the source generation named is gone
    with pytest.raises(gexc.NotFound):
        b.blob("new").compose([p0, p1], if_generation_match=0, retry=None)
    b.blob("new").compose([p0, b.get_blob("p1")], if_generation_match=0, retry=None)
    assert b.blob("new").download_as_bytes() == b"abXY" and b.blob("whole").download_as_bytes() == b"old"


def test_a_read_pinned_to_a_generation_fails_once_the_object_moved_on(gcs_proxy) -> None:
    b = _bucket(gcs_proxy)
    b.blob("k").upload_from_string(b"first")
    gen = b.get_blob("k").generation
    assert b.blob("k").download_as_bytes(if_generation_match=gen, retry=None) == b"first"
    b.blob("k").upload_from_string(b"second")
    with pytest.raises(gexc.PreconditionFailed):
        b.blob("k").download_as_bytes(if_generation_match=gen, retry=None)


def test_a_limited_connection_carries_every_byte(gcs_proxy) -> None:
    b = _bucket(gcs_proxy)
    gcs_proxy.proxy.limit(256 << 20)
    data = bytes(range(256)) * (4 << 10) + b"tail"  # 1 MiB and a bit, in many paced blocks each way
    b.blob("paced").upload_from_string(data, retry=None)
    assert b.blob("paced").download_as_bytes(retry=None) == data
    with pytest.raises(ValueError):
        gcs_proxy.proxy.limit(0)


def test_the_pace_waits_what_the_rate_asks_from_the_body_start() -> None:
    from drill.fault_proxy import _Pace

    now, waits = [100.0], []

    def sleep(s: float) -> None:
        waits.append(s)
        now[0] += s

    pace = _Pace(1000.0, clock=lambda: now[0], sleep=sleep)
    pace.after(500)             # 500 bytes at 1000 B/s: half a second from the start
    now[0] += 2.0               # the sender was slow itself: nothing to wait for
    pace.after(500)
    pace.after(3000)            # 4000 bytes in all are due at start + 4 s
    assert waits == [0.5, 1.5]
    free = _Pace(None, clock=lambda: now[0], sleep=sleep)
    free.after(10 ** 9)
    assert waits == [0.5, 1.5]
