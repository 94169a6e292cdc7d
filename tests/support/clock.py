"""The tests' one fake clock. It is Tensora's :class:`tensora.clock.FakeClock` (a :class:`tensora.clock.Clock`:
``now``, moved only by ``advance`` and ``set``), also callable, for the seams that take the time as a function
(the gateway's ``clock`` and ``wall``, a walk's clock, the limiters' minute): one clock a test moves by hand,
whichever seam it is handed to."""

from __future__ import annotations

from tensora import clock


class FakeClock(clock.FakeClock):
    """A clock that moves only when told to; ``clock()`` is ``clock.now()``."""

    def __call__(self) -> float:
        return self.now()
