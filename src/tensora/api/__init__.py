"""The control API: FastAPI app, one module of handlers per resource, schemas, auth, idempotency, limits."""
