"""Keys: the secrets that authenticate a caller. ``apikeys`` (what people hold: their form, checksum and digest)
and ``replicakeys`` (what only the gateway holds, to reach a model server on the local driver). A package of its
own: the control API issues keys and the gateway checks them, and neither may import the other."""
