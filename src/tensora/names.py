"""Names: the one rule for what people name (workloads, classes, regions, namespaces: a DNS label), and the name of
the store lease that makes a region's controller its only writer.

At the top of the package: the config files, the workload specs, the controller and the API all check names by
this one rule, and none of them is the others' to import for it."""

from __future__ import annotations

LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
"""A DNS label (RFC 1123): lowercase letters, digits and '-', 1-63 characters, a letter or digit at each end; it is a
Kubernetes object name, a hostname part and a path segment as it is."""

NAME_PATTERN = rf"^{LABEL}$"
DOMAIN_PATTERN = rf"^({LABEL}\.)+[a-z]{{2,63}}$"


def controller_lease(region: str) -> str:
    """The lease a region's leading controller holds (``controller/<region>``): the API asks who holds it."""
    return f"controller/{region}"
