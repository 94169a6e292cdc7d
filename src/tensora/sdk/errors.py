"""What the SDK raises: one tree, so a caller catches as broadly or narrowly as it likes.

    TensoraError                    (tensora.errors: everything Tensora raises on purpose)
    ├── APIError                    the control API said no, or could not be asked
    │   ├── AuthenticationError       401: no key, or a key that is unknown or revoked
    │   ├── PermissionDeniedError     403: the key lacks the scope, or it is someone else's
    │   ├── NotFoundError             404 (another owner's workload is a 404 too)
    │   ├── ConflictError             409: a state that forbids it now, an Idempotency-Key in flight
    │   ├── UnprocessableError        400/422: a field is wrong (``field`` names it)
    │   ├── RateLimitError            429
    │   ├── ServiceUnavailableError   503 (and 502, 504): retry later, ``retry_after`` says when
    │   ├── InternalServerError       500 and other 5xx
    │   └── APIConnectionError        no answer at all: refused, reset, DNS (``status`` is None)
    │       └── APITimeoutError       no answer in time
    └── WaitError                   ``wait_until`` gave up
        ├── WaitTimeoutError          the deadline passed (``workload`` is the last one seen)
        └── WorkloadEndedError        it ended (failed, stopped) before reaching the states asked for

Every APIError carries ``status``, ``body`` (the parsed JSON, or None), ``request_id`` (the
``x-request-id`` the server answered with), and from the API's error shape ``type``,
``field`` and ``message``.
"""

from __future__ import annotations

from typing import Any

from tensora.errors import TensoraError


class APIError(TensoraError):
    """An error response from the control API, or no response at all."""

    def __init__(self, message: str, *, status: int | None = None, body: Any = None, request_id: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.body, self.request_id = message, status, body, request_id
        self.headers = headers or {}
        detail = body.get("error") if isinstance(body, dict) else None
        detail = detail if isinstance(detail, dict) else {}
        self.type: str | None = detail.get("type")
        self.field: str | None = detail.get("field")

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        status = f"{self.status} " if self.status is not None else ""
        rid = f" [request {self.request_id}]" if self.request_id else ""
        return f"{status}{self.message}{where}{rid}"

    @property
    def retry_after(self) -> str | None:
        """The Retry-After header of the response, as sent."""
        return self.headers.get("retry-after")


class AuthenticationError(APIError):
    pass


class PermissionDeniedError(APIError):
    pass


class NotFoundError(APIError):
    pass


class ConflictError(APIError):
    pass


class UnprocessableError(APIError):
    pass


class RateLimitError(APIError):
    pass


class ServiceUnavailableError(APIError):
    pass


class InternalServerError(APIError):
    pass


class APIConnectionError(APIError):
    pass


class APITimeoutError(APIConnectionError):
    pass


_BY_STATUS: dict[int, type[APIError]] = {
    400: UnprocessableError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
    409: ConflictError, 422: UnprocessableError, 429: RateLimitError, 502: ServiceUnavailableError,
    503: ServiceUnavailableError, 504: ServiceUnavailableError,
}


def for_status(status: int) -> type[APIError]:
    """The exception class for an HTTP status."""
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return InternalServerError if status >= 500 else APIError


class WaitError(TensoraError):
    """``wait_until`` stopped waiting; ``workload`` is the last state it saw."""

    def __init__(self, message: str, workload: Any) -> None:
        super().__init__(message)
        self.workload = workload


class WaitTimeoutError(WaitError):
    pass


class WorkloadEndedError(WaitError):
    pass
