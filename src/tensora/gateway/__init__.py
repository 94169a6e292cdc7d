"""The regional inference gateway: OpenAI-compatible, keys, metering, rate limits, the fallback chain.

``chain`` (pure plan) and ``breaker`` (pure state) decide; ``upstream`` and ``proxy`` move bytes;
``routes`` is the table the control API hands over (kept in memory and on disk).
"""
