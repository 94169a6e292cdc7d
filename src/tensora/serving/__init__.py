"""How ``tensora serve`` and ``tensora up`` run as processes on one machine, apart from what they wire
(``tensora.serve``, the composition root): ``supervision`` (children that die with the server, the gateway's
process), ``workers`` (what an HTTP worker process is handed), ``uplock`` (one ``tensora up`` per data dir),
``ports`` (whether a port is free, and who holds it) and ``banner`` (what ``tensora up`` says)."""
