"""``notebook_domain``: notebooks are tenants' pages, so their domain is never the API's host nor a name above or
below it (same-site to the dashboard, or given its cookies outright); refused at load, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensora.config.settings import load_settings
from tensora.errors import ConfigError

CASES = {  # (host, notebook_domain) -> refused
    "a domain of its own beside the API's name": (("tensora.example.org", "tensora-nb.net"), False),
    "the API's own host": (("tensora.example.org", "tensora.example.org"), True),
    "under the API's host": (("tensora.example.org", "nb.tensora.example.org"), True),
    "above the API's host (its parent domain)": (("tensora.example.org", "example.org"), True),
    "the same, whatever the case and a final dot": (("Tensora.Example.org.", "tensora.example.org"), True),
    "a look-alike suffix is not a parent": (("tensora.example.org", "ample.org"), False),
    "the API bound on an address: nothing to compare": (("0.0.0.0", "nb.example.org"), False),
    "the default loopback address": (("127.0.0.1", "nb.example.org"), False),
    "an IPv6 address": (("::", "nb.example.org"), False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_notebook_domain_apart_from_the_apis_host(case: tuple[tuple[str, str], bool], tmp_path: Path) -> None:
    (host, domain), refused = case
    config = tmp_path / "config.yaml"
    config.write_text(f"driver: kubernetes\nhost: '{host}'\nnotebook_domain: {domain}\n")
    if not refused:
        assert load_settings(config, {}, env={}).notebook_domain == domain
        return
    with pytest.raises(ConfigError, match="registrable domain") as caught:
        load_settings(config, {}, env={})
    assert "notebook_domain" in str(caught.value)
