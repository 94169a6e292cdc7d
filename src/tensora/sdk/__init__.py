"""The Python SDK: ``Client``, ``AsyncClient``, the retry policy and the exception tree."""

from tensora.sdk.calls import Catalog, CurrentKey, Event, Key, Owner, TokenUsage, Usage, Workload
from tensora.sdk.client import AsyncClient, Client
from tensora.sdk.errors import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AuthenticationError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
    UnprocessableError,
    WaitError,
    WaitTimeoutError,
    WorkloadEndedError,
)
from tensora.sdk.retry import RetryBudget, RetryPolicy

__all__ = [
    "APIConnectionError",
    "APIError",
    "APITimeoutError",
    "AsyncClient",
    "AuthenticationError",
    "Catalog",
    "Client",
    "ConflictError",
    "CurrentKey",
    "Event",
    "InternalServerError",
    "Key",
    "NotFoundError",
    "Owner",
    "PermissionDeniedError",
    "RateLimitError",
    "RetryBudget",
    "RetryPolicy",
    "ServiceUnavailableError",
    "TokenUsage",
    "UnprocessableError",
    "Usage",
    "WaitError",
    "WaitTimeoutError",
    "Workload",
    "WorkloadEndedError",
]
