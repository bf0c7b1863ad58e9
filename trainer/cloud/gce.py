"""Google Cloud REST calls made from a VM or a serverless job, with the standard library only.

A token from the metadata server (`GCE_METADATA_HOST` overrides the host), JSON over HTTPS, retries
by `trainer.retry`'s rule (`REST`: 408, 429, 5xx and dropped connections, six tries in all), and
Google's error body turned into one `ApiError` line. Endpoints are overridable so that loopback
fakes can stand in for Google:
`SPOTTRAIN_COMPUTE_API` (default https://compute.googleapis.com/compute/v1), `SPOTTRAIN_RUN_API`
(default https://run.googleapis.com/v2), `SPOTTRAIN_SECRETMANAGER_API` (default
https://secretmanager.googleapis.com/v1) and `STORAGE_EMULATOR_HOST` (as the google-cloud-storage
client reads it). The trainer's own checkpoint traffic goes through google-cloud-storage; this
module serves the small control-plane calls (`trainer.cloud.scale`, `trainer.cloud.control`,
`trainer.cloud.capacity`) that must work before or without it.

Nothing here waits on a Compute operation: `zoneOperations.get`/`wait` need
`compute.zoneOperations.get`, which no role of ours grants (an operation cannot be named in a
condition, so the permission would cover every operation of the project). A caller confirms what
it asked for from the resource itself (`until`), with the permission it already has to read it.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

from trainer import retry

DEFAULT_COMPUTE = "https://compute.googleapis.com/compute/v1"
DEFAULT_RUN = "https://run.googleapis.com/v2"
DEFAULT_STORAGE = "https://storage.googleapis.com"
#: Secret Manager's REST endpoint; a loopback fake stands in for it in tests and the drill.
SECRETMANAGER_ENV = "SPOTTRAIN_SECRETMANAGER_API"
DEFAULT_SECRETMANAGER = "https://secretmanager.googleapis.com/v1"
DEFAULT_METADATA_HOST = "metadata.google.internal"
# Loopback fakes must never be reached through a proxy; Google's endpoints may be.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ApiError(Exception):
    """A refused or failed call: HTTP status (0: no answer), Google's status name and message."""

    def __init__(self, code: int, status: str, message: str, url: str) -> None:
        super().__init__(f"{code} {status}: {message} ({url})")
        self.code, self.status, self.message, self.url = code, status, message, url


def metadata_host() -> str:
    return os.environ.get("GCE_METADATA_HOST") or DEFAULT_METADATA_HOST


def metadata(path: str, timeout: float = 5.0) -> str:
    """One value from the metadata server, e.g. metadata("instance/zone"); ApiError if absent."""
    url = f"http://{metadata_host()}/computeMetadata/v1/{path.lstrip('/')}"
    req = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with _DIRECT.open(req, timeout=timeout) as resp:
            return resp.read().decode()
    except urllib.error.HTTPError as e:
        raise ApiError(e.code, "METADATA", e.reason or "error", url) from None
    except (OSError, http.client.HTTPException) as e:
        raise ApiError(0, "UNREACHABLE", str(e), url) from None


def metadata_token() -> tuple[str, float]:
    """(access token, seconds it stays valid) of the VM's service account."""
    answer = json.loads(metadata("instance/service-accounts/default/token"))
    return answer["access_token"], float(answer.get("expires_in", 300))


@dataclass
class Client:
    """JSON calls to Compute Engine and Cloud Storage as one identity.

    `token`: a callable returning (token, seconds valid); default: the metadata server's.
    `sleep` is injectable so tests of the retry path do not wait."""

    token: Callable[[], tuple[str, float]] = metadata_token
    compute: str = ""
    storage: str = ""
    run: str = ""
    timeout: float = 30.0
    retries: int = (retry.REST.attempts or 1) - 1  # tries after the first
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        self.compute = (self.compute or os.environ.get("SPOTTRAIN_COMPUTE_API") or DEFAULT_COMPUTE).rstrip("/")
        self.storage = (self.storage or os.environ.get("STORAGE_EMULATOR_HOST") or DEFAULT_STORAGE).rstrip("/")
        self.run = (self.run or os.environ.get("SPOTTRAIN_RUN_API") or DEFAULT_RUN).rstrip("/")
        self._token: str | None = None
        self._expires = 0.0

    def _bearer(self) -> str:
        if self._token is None or time.monotonic() > self._expires - 60:
            self._token, valid = self.token()
            self._expires = time.monotonic() + valid
        return self._token

    def request(self, method: str, url: str, *, body: Any = None, query: dict[str, Any] | None = None,
                data: bytes | None = None, content_type: str = "application/json",
                ok404: bool = False, ok412: bool = False, raw: bool = False) -> Any:
        """The decoded JSON answer (the bytes with `raw`; None for an empty answer, or a 404/412
        the caller accepts)."""
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        payload = data if data is not None else (json.dumps(body).encode() if body is not None else None)
        def once() -> Any:
            headers = {"Authorization": f"Bearer {self._bearer()}"}
            if payload is not None:
                headers["Content-Type"] = content_type
            req = urllib.request.Request(url, data=payload, method=method, headers=headers)
            opener = _DIRECT if urllib.parse.urlsplit(url).hostname in ("127.0.0.1", "localhost") \
                else urllib.request.build_opener()
            try:
                with opener.open(req, timeout=self.timeout) as resp:
                    answer = resp.read()
                    return answer if raw else json.loads(answer) if answer.strip() else None
            except urllib.error.HTTPError as e:
                answer = e.read()
                if (e.code == 404 and ok404) or (e.code == 412 and ok412):
                    return None
                raise _api_error(e.code, answer, url) from None
            except (OSError, http.client.HTTPException) as e:
                raise ApiError(0, "UNREACHABLE", str(e), url) from None

        policy = dataclasses.replace(retry.REST, attempts=self.retries + 1)
        return retry.Retry(policy, sleep=self.sleep).call(once, f"{method} {url}")

    # --- Compute Engine ----------------------------------------------------------------------
    def compute_call(self, method: str, path: str, *, body: Any = None, query: dict[str, Any] | None = None,
                     beta: bool = False, ok404: bool = False) -> Any:
        base = self.compute
        if beta and base.endswith("/v1"):
            base = base[: -len("/v1")] + "/beta"
        return self.request(method, f"{base}/{path.lstrip('/')}", body=body, query=query, ok404=ok404)

    def until(self, probe: Callable[[], Any], done: Callable[[Any], bool], what: str,
              timeout: float = 300.0, interval: float = 2.0) -> Any:
        """Call `probe` until `done(answer)`; ApiError(0, DEADLINE_EXCEEDED) after `timeout`.
        How a change is confirmed: a group's `targetSize`, an instance's `status`, a resize
        request's existence, read with the caller's own permission on that resource."""
        deadline = time.monotonic() + timeout
        while True:
            answer = probe()
            if done(answer):
                return answer
            if time.monotonic() > deadline:
                raise ApiError(0, "DEADLINE_EXCEEDED", f"{what}: not after {timeout:.0f}s (last seen: {answer})", "")
            self.sleep(interval)

    # --- Cloud Run (v2) ----------------------------------------------------------------------
    def run_job(self, job: str) -> dict[str, Any]:
        """Start one execution of a Cloud Run job (`projects/P/locations/R/jobs/J`); its
        long-running operation, which nobody needs to wait on (the job reports in the bucket)."""
        return self.request("POST", f"{self.run}/{job}:run", body={})

    # --- Secret Manager ----------------------------------------------------------------------
    def secret_version(self, secret: str, version: str = "1") -> bytes | None:
        """The payload of ``secret``'s (``projects/P/secrets/S``) ``version``; None when the secret
        or the version does not exist (404). Read only: never adds a version."""
        import base64
        import binascii

        api = (os.environ.get(SECRETMANAGER_ENV) or DEFAULT_SECRETMANAGER).rstrip("/")
        answer = self.request("GET", f"{api}/{secret}/versions/{version}:access", ok404=True)
        if answer is None:
            return None
        try:
            return base64.b64decode(answer["payload"]["data"], validate=True)
        except (KeyError, TypeError, binascii.Error):
            raise ApiError(200, "MALFORMED", f"{secret} version {version} answered without a base64 payload",
                           api) from None

    # --- Cloud Storage (JSON API) -----------------------------------------------------------
    def object_exists(self, bucket: str, name: str) -> bool:
        url = f"{self.storage}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"
        return self.request("GET", url, ok404=True) is not None

    def object_sizes(self, bucket: str, prefix: str) -> dict[str, int]:
        """Every object under ``prefix``: name -> size in bytes."""
        sizes: dict[str, int] = {}
        token = None
        while True:
            query: dict[str, Any] = {"prefix": prefix, "fields": "items(name,size),nextPageToken"}
            if token:
                query["pageToken"] = token
            page = self.request("GET", f"{self.storage}/storage/v1/b/{bucket}/o", query=query) or {}
            for o in page.get("items", []):
                try:
                    sizes[o["name"]] = int(o.get("size", -1))
                except (TypeError, ValueError):
                    sizes[o["name"]] = -1
            token = page.get("nextPageToken")
            if not token:
                return sizes

    def delete_object(self, bucket: str, name: str) -> None:
        """Delete an object; a missing one is fine."""
        url = f"{self.storage}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"
        self.request("DELETE", url, ok404=True)

    def read_object(self, bucket: str, name: str) -> bytes | None:
        url = f"{self.storage}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"
        return self.request("GET", url, query={"alt": "media"}, ok404=True, raw=True)

    def write_object(self, bucket: str, name: str, data: bytes) -> None:
        """Overwrite (the capacity check's own state object)."""
        self.request("POST", f"{self.storage}/upload/storage/v1/b/{bucket}/o", data=data,
                     content_type="application/octet-stream", query={"uploadType": "media", "name": name})


def _api_error(code: int, raw: bytes, url: str) -> ApiError:
    try:
        err = json.loads(raw).get("error", {})
        if isinstance(err, dict):
            return ApiError(code, str(err.get("status") or code), str(err.get("message") or ""), url)
        return ApiError(code, str(err), raw.decode(errors="replace")[:300], url)
    except (ValueError, AttributeError):
        return ApiError(code, str(code), raw.decode(errors="replace")[:300], url)
