"""Per-replica API keys: derived from one secret per data dir, stable, and different per replica and secret."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tensora.config.settings import ServeSettings
from tensora.keys import replicakeys
from tensora.serve import build

A, B = b"a" * replicakeys.SECRET_BYTES, b"b" * replicakeys.SECRET_BYTES

DERIVE_CASES = {
    "the same secret and replica -> the same key": ((A, "rp_1"), (A, "rp_1"), True),
    "another replica -> another key": ((A, "rp_1"), (A, "rp_2"), False),
    "another secret (data dir) -> another key": ((A, "rp_1"), (B, "rp_1"), False),
}


@pytest.mark.parametrize("case", DERIVE_CASES.values(), ids=DERIVE_CASES.keys())
def test_derive(case: tuple[tuple[bytes, str], tuple[bytes, str], bool]) -> None:
    one, other, same = case
    assert (replicakeys.derive(*one) == replicakeys.derive(*other)) is same


def test_a_key_stays_what_it_was() -> None:
    """Pinned: a replica adopted after an upgrade keeps the key it was started with, so the derivation may
    never change."""
    assert replicakeys.derive(A, "rp_1") == "f2ea5fc6ed0f4cc540e18d7169364d979d67b7d75d9486a551fb764916b6abe5"


def test_the_secret_is_made_once_0600_and_kept(tmp_path: Path) -> None:
    first = replicakeys.ensure_secret(tmp_path / "data")
    path = tmp_path / "data" / replicakeys.SECRET_FILE
    assert len(first) == replicakeys.SECRET_BYTES and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert replicakeys.ensure_secret(tmp_path / "data") == first
    assert [p.name for p in (tmp_path / "data").iterdir()] == [replicakeys.SECRET_FILE]  # no temp file left
    assert replicakeys.ensure_secret(tmp_path / "other") != first


def test_a_secret_file_of_the_wrong_size_is_refused_not_used(tmp_path: Path) -> None:
    (tmp_path / replicakeys.SECRET_FILE).write_bytes(b"short")
    with pytest.raises(ValueError, match="not a replica key secret"):
        replicakeys.ensure_secret(tmp_path)


@pytest.mark.parametrize(("driver", "keyed"), [("local", True), ("simulated", False)])
def test_the_api_holds_the_secret_only_on_the_local_driver(tmp_path: Path, driver: str, keyed: bool) -> None:
    svc = build(ServeSettings(data_dir=tmp_path, driver=driver, controller=False))  # type: ignore[arg-type]
    try:
        assert (svc.replica_secret == replicakeys.ensure_secret(tmp_path)) if keyed else svc.replica_secret is None
    finally:
        svc.db.dispose()
