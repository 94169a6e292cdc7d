"""Test helpers: builders, real services (PostgreSQL, Redis), the stack in process, the harness, the doubles."""
