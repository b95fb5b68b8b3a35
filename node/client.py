"""HTTP client for the validator service, used by contributors, the trainer and the harness.

Retries with exponential backoff on 429 (honouring Retry-After) and on
connection errors; every other error status raises :class:`ServiceError`
carrying the validator's reason code.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec

from node.validator.auth import sign_request
from verify.errors import ProofTrainError, Reason
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
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"validator answered {status} [{reason}]: {message}")
        self.status = status
        try:
            self.reason = Reason(reason)
        except ValueError:
            self.reason = Reason.MALFORMED


class ValidatorClient:
    def __init__(
        self,
        base_url: str,
        key: SigningKey,
        *,
        timeout: float = 60.0,
        retries: int = 5,
        backoff: float = 0.2,
    ) -> None:
        self.key = key
        self.retries, self.backoff = retries, backoff
        self.http = httpx.Client(base_url=base_url, timeout=timeout)

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
        for attempt in range(self.retries + 1):
            headers = {"content-type": "application/msgpack"}
            if signed:
                headers.update(
                    sign_request(self.key, method, target, body, time.time_ns() // 1_000_000)
                )
            try:
                resp = self.http.request(method, target, content=body, headers=headers)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
                time.sleep(self.backoff * 2**attempt)
                continue
            if resp.status_code == 429 and attempt < self.retries:
                time.sleep(
                    max(float(resp.headers.get("retry-after", "0") or 0), self.backoff * 2**attempt)
                )
                continue
            if resp.status_code >= 400:
                try:
                    err = resp.json()
                except ValueError:
                    err = {"reason": "malformed", "message": resp.text[:200]}
                raise ServiceError(resp.status_code, err.get("reason", "?"), err.get("message", ""))
            return resp
        raise AssertionError("unreachable")

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
