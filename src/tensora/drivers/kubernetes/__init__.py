"""The Kubernetes driver's parts: ``cluster`` (capacity from Node and Pod objects) and ``render``
(the objects of one replica), both pure."""
