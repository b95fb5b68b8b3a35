"""HTTP client for the validator service, used by contributors, the trainer and the harness.

Retries with exponential backoff on 429 (honouring Retry-After) and on
connection errors; every other error status raises :class:`ServiceError`
carrying the validator's reason code and the URL asked. A validator still
unreachable after the retries raises :class:`ValidatorUnreachable` (an
``httpx.TransportError`` that names the URL); a TLS handshake that fails (an
``https://`` URL on a plain-HTTP port) raises ConfigError at once, unretried.

With ``wait_out`` (:data:`WaitOut`) a client rides out a validator that cannot
answer for longer than the retries last: one that stays unreachable (a restart,
which verifies the ledger first), stays busy (429) or has a full disk (503
``storage_full``, or a proxy's 503 while the node behind it is down) is sent the
same request again for as long as ``wait_out`` says to; any other error status is
still raised at once. A 429 or 503 recorded nothing. A request that timed out may
have been recorded before its answer was lost; the validator answers the same
publication, sent again, with the version it recorded.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from node.validator.auth import sign_request
from verify.errors import ConfigError, ProofTrainError, Reason
from verify.keys import SigningKey
from verify.registration import WorkParams, solve
from verify.types import (
    GroupSubmission,
    SampleBatch,
    SignedAssignment,
    SignedEvalStatement,
    SignedGroupVerdict,
    SignedManifest,
    canonical_bytes,
    decode,
)


class ServiceError(ProofTrainError):
    """An error status from the validator (``url``: what was asked, when known)."""

    def __init__(self, status: int, reason: str, message: str, url: str = "") -> None:
        code = f" [{reason}]" if reason else ""  # "": the answer carried no reason code
        super().__init__(f"{url or 'validator'} answered {status}{code}: {message}")
        self.status, self.url = status, url
        try:
            self.reason = Reason(reason)
        except ValueError:
            self.reason = Reason.MALFORMED

    @property
    def busy(self) -> bool:
        """The validator could not take the request now (429, 5xx): ask again later. Any
        other status is its final answer to that request."""
        return (
            self.status == 429
            or self.status >= 500
            or self.reason in (Reason.BACKPRESSURE, Reason.RATE_LIMITED)
        )


class ValidatorUnreachable(httpx.TransportError, ProofTrainError):
    """No answer from ``url`` (refused, reset, timed out) after the client's retries."""

    def __init__(self, url: str, cause: Exception) -> None:
        super().__init__(f"cannot reach the validator at {url}: {cause or type(cause).__name__}")
        self.url = url


def _tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind a connection error, if that is what it was."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


MAX_RETRY_AFTER_S = 3600.0
"""The longest Retry-After the client honours (a larger one is read as this)."""


def _retry_after(resp: httpx.Response) -> float | None:
    """The seconds a refusal's Retry-After asks for, at most ``MAX_RETRY_AFTER_S``; None when
    it is absent or not a number of seconds (an HTTP date is not read)."""
    try:
        seconds = float(resp.headers.get("retry-after", ""))
    except ValueError:
        return None
    return min(seconds, MAX_RETRY_AFTER_S) if seconds >= 0 else None  # NaN is not >= 0


def _service_error(resp: httpx.Response, url: str, base: str) -> ServiceError:
    """The error an error status means; an answer without a reason code did not come from a
    prooftrain validator's routes (a wrong path or port)."""
    try:
        err = resp.json()
    except ValueError:
        err = None
    if not isinstance(err, dict) or "reason" not in err:
        return ServiceError(
            resp.status_code,
            "",
            f"{resp.reason_phrase}, without a reason code: is {base} a prooftrain "
            "validator's address?",
            url,
        )
    return ServiceError(resp.status_code, str(err["reason"]), str(err.get("message", "")), url)


WaitOut = Callable[[ProofTrainError, float], bool]
"""Called when the validator still cannot answer after the client's retries, with that error
(:class:`ValidatorUnreachable`, or a :class:`ServiceError` of status 429 or 503) and the
seconds the validator asked to wait (its Retry-After; the last backoff when unreachable):
waits, then returns True to send the request again or False to raise the error."""

UNREACHABLE_WAIT_S = 5.0
"""Seconds between tries that a ``wait_out`` client is given for a validator that stays
unreachable (a restarting node answers again within seconds of its ledger check), or that
refuses without a Retry-After."""

WAITED_OUT = (429, 503)
"""Refusals a ``wait_out`` client waits out: busy, and a full disk (or a proxy whose node is
down). Neither recorded anything."""


def waited_out(exc: BaseException) -> bool:
    """Whether ``exc`` is an error a ``wait_out`` client waits out before raising it (so a
    caller that stopped its waits can tell them from a final answer)."""
    return isinstance(exc, ValidatorUnreachable) or (
        isinstance(exc, ServiceError) and exc.status in WAITED_OUT
    )


class ValidatorClient:
    def __init__(
        self,
        base_url: str,
        key: SigningKey,
        *,
        timeout: float = 60.0,
        retries: int = 5,
        backoff: float = 0.2,
        wait_out: WaitOut | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.key = key
        self.retries, self.backoff, self.wait_out = retries, backoff, wait_out
        self.http = httpx.Client(base_url=base_url, timeout=timeout, transport=transport)

    def close(self) -> None:
        self.http.close()

    def _request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        signed: bool = False,
        params: dict[str, Any] | None = None,
    ) -> httpx.Response:
        target = path + (("?" + str(httpx.QueryParams(params))) if params else "")
        url = str(self.http.base_url).rstrip("/") + path
        attempt = 0
        while True:
            headers = {"content-type": "application/msgpack"}
            if signed:
                headers.update(
                    sign_request(self.key, method, target, body, time.time_ns() // 1_000_000)
                )
            try:
                resp = self.http.request(method, target, content=body, headers=headers)
            except httpx.TransportError as exc:
                if (tls := _tls_failure(exc)) is not None:
                    raise ConfigError(
                        f"the TLS handshake with {url} failed ({tls.reason or tls}): does the "
                        "validator serve https there? A node serves plain http:// itself"
                    ) from None
                if attempt < self.retries:
                    time.sleep(self.backoff * 2**attempt)
                    attempt += 1
                    continue
                gone = ValidatorUnreachable(url, exc)
                if self.wait_out is None or not self.wait_out(gone, UNREACHABLE_WAIT_S):
                    raise gone from None
                attempt = 0
                continue
            if resp.status_code == 429 and attempt < self.retries:
                time.sleep(max(_retry_after(resp) or 0.0, self.backoff * 2**attempt))
                attempt += 1
                continue
            if resp.status_code >= 400:
                error = _service_error(resp, url, str(self.http.base_url).rstrip("/"))
                asked = _retry_after(resp)
                if (
                    resp.status_code not in WAITED_OUT
                    or self.wait_out is None
                    or not self.wait_out(error, UNREACHABLE_WAIT_S if asked is None else asked)
                ):
                    raise error
                attempt = 0
                continue
            return resp

    def info(self) -> dict[str, Any]:
        return self._request("GET", "/v1/info").json()

    def register(self, name: str = "") -> bool:
        """Register this key (False: it already was), first making the registration proof of
        work the node asks for in /v1/info, if any (``verify.registration``)."""
        try:  # a known key needs no proof: it paid once
            return self._register({"name": name})
        except ServiceError as exc:
            if exc.reason is not Reason.REGISTRATION_WORK:
                raise
        info = self.info()
        asked = info.get("network", {}).get("registration", {})
        params = WorkParams(int(asked.get("work_bits", 0)), int(asked.get("work_log2_n", 14)))
        work = solve(self.key.public.raw, str(info["origin"]), params)
        return self._register({"name": name, "work": work})

    def _register(self, fields: dict[str, Any]) -> bool:
        body = msgspec.json.encode(fields)
        return bool(self._request("POST", "/v1/register", body, signed=True).json()["registered"])

    def assign(self) -> SignedAssignment:
        data = self._request("POST", "/v1/assign", b"", signed=True).content
        return decode(SignedAssignment, data, max_bytes=len(data))

    def submit(self, group: GroupSubmission | bytes) -> SignedGroupVerdict:
        """The validator's signed verdicts on ``group`` (``verify.signed.open_group_verdict``
        checks and opens them)."""
        body = group if isinstance(group, bytes) else canonical_bytes(group)
        data = self._request("POST", "/v1/submit", body).content
        return decode(SignedGroupVerdict, data, max_bytes=len(data))

    def samples(self, cursor: int, limit: int = 256) -> SampleBatch:
        data = self._request(
            "GET", "/v1/samples", signed=True, params={"cursor": cursor, "limit": limit}
        ).content
        return decode(SampleBatch, data, max_bytes=len(data))

    def publish(self, sealed: SignedManifest) -> int:
        return int(
            self._request("POST", "/v1/policy", canonical_bytes(sealed), signed=True).json()[
                "version"
            ]
        )

    def record_eval(self, sealed: SignedEvalStatement) -> int:
        """Record a trainer-signed eval statement; returns its ledger index."""
        body = canonical_bytes(sealed)
        return int(self._request("POST", "/v1/trainer/eval", body, signed=True).json()["index"])

    def recorded_evals(self) -> list[int]:
        """The versions the validator's ledger holds an eval of by its trainer key."""
        return [int(v) for v in self._request("GET", "/v1/trainer/evals").json()["versions"]]

    def manifest(self, version: int) -> SignedManifest:
        data = self._request("GET", f"/v1/policy/{version}").content
        return decode(SignedManifest, data, max_bytes=len(data))

    def put_blob(self, data: bytes) -> bytes:
        return bytes.fromhex(self._request("POST", "/v1/blobs", data, signed=True).json()["digest"])

    def blob(self, digest: bytes) -> bytes:
        return self._request("GET", f"/v1/blobs/{digest.hex()}").content
