"""The regional inference gateway: OpenAI-compatible, keys, metering, rate limits, the fallback chain.

``chain`` (pure plan) and ``breaker`` (pure state) decide; ``proxy`` (the edge: key, body, limits), ``walk``
(the chain's attempts), ``relay`` (the answer) and ``upstream`` (the connections to backends) move bytes, served by
``server``; ``routes`` is the table the control API hands over (kept in memory and on disk); ``app`` builds it all.
"""
