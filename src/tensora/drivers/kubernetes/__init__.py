"""The Kubernetes driver's parts: ``cluster`` (capacity from Node and Pod objects, pure)."""
