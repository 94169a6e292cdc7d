"""The guard of the compiled modules (``tensora.native``): a build runs only while it matches its sources, all of
its group or none; ``TENSORA_PURE`` runs the source."""

from __future__ import annotations

import importlib.machinery
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from tensora import native

GROUP = ("pkg.a", "pkg.b")
OTHER = ("pkg.c",)  # another group: fresh whatever the first one is
EXT = importlib.machinery.EXTENSION_SUFFIXES[0]


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake install: two sources, an extension file beside each, and the manifest of their digests."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tensora").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "pkg" / f"{name}.py").write_text(f"NAME = {name!r}\n")
        (tmp_path / "pkg" / f"{name}{EXT}").write_bytes(b"not loaded by these tests")
    digests = {m: native.digest(tmp_path / "pkg" / f"{m[4:]}.py") for m in GROUP + OTHER}
    (tmp_path / "tensora" / native.MANIFEST).write_text(json.dumps({"sources": digests}))
    monkeypatch.setattr(native, "_ROOT", tmp_path)
    monkeypatch.setattr(native, "GROUPS", {"g": GROUP, "other": OTHER})
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    return tmp_path


def _edit_b(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "pkg" / "b.py").write_text("NAME = 'b, edited'\n")


def _no_manifest(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "tensora" / native.MANIFEST).unlink()


def _garbled_manifest(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "tensora" / native.MANIFEST).write_text("{not json")


def _b_not_built(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "pkg" / f"b{EXT}").unlink()


def _none_built(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a", "b"):
        (root / "pkg" / f"{name}{EXT}").unlink()


def _left_pure_by_the_build(why: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """A pure build: no extension of the group, and the manifest says why (as setup.py writes it)."""
    def change(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        _none_built(root, monkeypatch)
        (root / "tensora" / native.MANIFEST).write_text(json.dumps({"sources": {}, "pure": {"g": why}}))
    return change


def _none_built_nor_recorded(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _none_built(root, monkeypatch)
    _no_manifest(root, monkeypatch)


def _pure_asked(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.PURE_ENV, "1")


def _pure_zero(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.PURE_ENV, "0")


CASES: dict[str, tuple[Callable[[Path, pytest.MonkeyPatch], None], str | None]] = {
    "a fresh build runs": (lambda root, mp: None, None),
    "TENSORA_PURE=0 is not a request": (_pure_zero, None),
    "a source edited since the build": (_edit_b, "b.py changed since it was compiled"),
    "no manifest": (_no_manifest, "manifest (_native_build.json) is missing or unreadable"),
    "a manifest that is not JSON": (_garbled_manifest, "manifest (_native_build.json) is missing or unreadable"),
    "one module of the group not built": (_b_not_built, "pkg.b was not compiled"),
    "nothing of the group built, though the build compiled it": (_none_built, "its extension files are gone"),
    "left pure at install: no compiler": (_left_pure_by_the_build("no C compiler (cc)"),
                                          "not compiled at install: no C compiler (cc)"),
    "left pure at install: mypyc refused the group": (
        _left_pure_by_the_build("mypyc refused it: src/x.py:3: error: Name 'y' is not defined"),
        "not compiled at install: mypyc refused it: src/x.py:3: error"),
    "left pure at install: TENSORA_PURE then": (_left_pure_by_the_build("TENSORA_PURE was set at install"),
                                                "not compiled at install: TENSORA_PURE was set at install"),
    "nothing built and no record of a build (a source tree)": (_none_built_nor_recorded,
                                                               "not compiled (no record of a build"),
    "TENSORA_PURE set": (_pure_asked, "TENSORA_PURE is set"),
}


@pytest.mark.parametrize("case", CASES)
def test_why_the_group_runs_from_source(case: str, tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    change, reason = CASES[case]
    change(tree, monkeypatch)
    why = native.why_pure("g")
    if reason is None:
        assert why is None
    else:
        assert why is not None and reason in why


def test_a_stale_group_is_found_from_source_whole_and_said_once(tree: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _edit_b(tree, monkeypatch)
    finder = native._FromSource()
    with pytest.warns(native.NativeStaleWarning, match="b.py changed since it was compiled"):
        spec_a = finder.find_spec("pkg.a", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once: no second warning
        spec_b = finder.find_spec("pkg.b", None)
    assert spec_a is not None and spec_a.origin == str(tree / "pkg" / "a.py")  # a itself is unchanged: still source
    assert spec_b is not None and spec_b.origin == str(tree / "pkg" / "b.py")
    assert finder.find_spec("pkg.c", None) is None  # the other group is fresh: the usual finders
    assert finder.find_spec("pkg.d", None) is None  # of no group


def test_a_fresh_group_is_left_to_the_usual_finders(tree: Path) -> None:
    finder = native._FromSource()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert finder.find_spec("pkg.a", None) is None
        assert finder.find_spec("pkg.b", None) is None


def test_pure_on_request_says_nothing(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _pure_asked(tree, monkeypatch)
    finder = native._FromSource()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = finder.find_spec("pkg.a", None)
    assert spec is not None and spec.origin == str(tree / "pkg" / "a.py")


def test_import_tensora_puts_the_guard_first() -> None:
    import sys

    assert sys.meta_path.index(native._finder) < min(
        i for i, f in enumerate(sys.meta_path) if f is not native._finder)


def test_every_compiled_module_is_a_source_of_the_package() -> None:
    for modules in native.GROUPS.values():
        for module in modules:
            assert native.source(module).is_file(), module


def test_a_group_left_pure_at_install_runs_from_source_silently(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _left_pure_by_the_build("no C compiler (cc)")(tree, monkeypatch)
    finder = native._FromSource()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the install said it; every import need not
        spec = finder.find_spec("pkg.a", None)
    assert spec is not None and spec.origin == str(tree / "pkg" / "a.py")
