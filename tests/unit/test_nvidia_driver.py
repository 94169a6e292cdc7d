"""A sandboxed GPU replica gets the host's NVIDIA driver (libcuda, NVML, nvidia-smi) beside its device nodes,
found as nvidia-container-toolkit finds it, as values on a fake driver folder: no GPU needed. Checked on an
H200 host, whose driver is a read-only mount at /usr/local/nvidia that the sandbox's /usr does not show."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tensora.drivers import launch as plan
from tensora.models import runtimes
from tensora.placement.catalog import ComputeClass, Kind
from tensora.sandbox import CgroupVersion, Device, HostFacts, oci_config
from tensora.sandbox.host import NvidiaDriver, nvidia_driver, parse_ldconfig

GPU = ComputeClass("h200-141gb", Kind.GPU, 16, 240 << 30, "H200", 1, 141 << 30)
VENV = plan.PythonEnv("/srv/runtimes/transformers/venv", "/usr", "/srv/runtimes/transformers/venv/bin/python")
HOST = HostFacts(cgroup=CgroupVersion.V2, arch="x86_64", system_dirs=(("/usr", "/usr"), ("/etc", "/etc")))
VERSION = "580.159.04"

# ``ldconfig -p`` as the H200 host printed it (abridged): the driver's folder first, stale copies under /lib after
LDCONFIG = f"""\
1234 libs found in cache `/etc/ld.so.cache'
\tlibnvidia-tls.so.{VERSION} (libc6,x86-64) => {{nv}}/libnvidia-tls.so.{VERSION}
\tlibnvidia-ml.so.1 (libc6,x86-64) => {{nv}}/libnvidia-ml.so.1
\tlibnvidia-ml.so.1 (libc6,x86-64) => {{stale}}/libnvidia-ml.so.1
\tlibcudart.so.13 (libc6,x86-64) => /usr/local/cuda-13.0/lib/libcudart.so.13
\tlibcuda.so.1 (libc6,x86-64) => {{nv}}/libcuda.so.1
\tlibcuda.so.1 (libc6) => /usr/lib32/libcuda.so.1
\tlibcuda.so (libc6,x86-64) => {{nv}}/libcuda.so
"""

PARSE_CASES = {
    "x86-64 rows in the loader's order, 32-bit ones and the header left out": (
        "1 libs found\n\tlibcuda.so.1 (libc6,x86-64) => /a/libcuda.so.1\n\tlibcuda.so.1 (libc6) => /b/libcuda.so.1\n",
        "x86_64", [("libcuda.so.1", "/a/libcuda.so.1")]),
    "an OS ABI flag after the machine type": (
        "\tlibcuda.so.1 (libc6,x86-64, OS ABI: Linux 3.2.0) => /a/libcuda.so.1\n", "x86_64",
        [("libcuda.so.1", "/a/libcuda.so.1")]),
    "arm64 hosts say AArch64": (
        "\tlibcuda.so.1 (libc6,AArch64) => /a/libcuda.so.1\n\tlibcuda.so.1 (libc6,x86-64) => /b/libcuda.so.1\n",
        "aarch64", [("libcuda.so.1", "/a/libcuda.so.1")]),
    "nothing": ("", "x86_64", []),
}


@pytest.mark.parametrize("case", PARSE_CASES.values(), ids=PARSE_CASES.keys())
def test_parse_ldconfig(case: tuple[str, str, list[tuple[str, str]]]) -> None:
    text, arch, want = case
    assert parse_ldconfig(text, arch) == want


def _driver_folder(root: Path) -> tuple[Path, Path]:
    """A driver as NVIDIA installs it: versioned files, their soname and dev links; nvidia-smi in bin/."""
    lib, bin_ = root / "nvidia" / "lib64", root / "nvidia" / "bin"
    lib.mkdir(parents=True)
    bin_.mkdir(parents=True)
    for base, soname in (("libcuda.so", "libcuda.so.1"), ("libnvidia-ml.so", "libnvidia-ml.so.1"),
                         ("libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"),
                         ("libnvidia-tls.so", None)):  # not a compute or utility library
        real = lib / f"{base}.{VERSION}"
        real.write_text(base)
        if soname:
            (lib / soname).symlink_to(real.name)
        (lib / base).symlink_to(real.name)
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\n")
    (bin_ / "nvidia-smi").chmod(0o755)
    return lib, bin_


def _names(found: tuple[tuple[str, str], ...]) -> dict[str, str]:
    return {name: Path(path).name for name, path in found}


CUDA_NAMES = {"libcuda.so.1": f"libcuda.so.{VERSION}", "libcuda.so": f"libcuda.so.{VERSION}",
              f"libcuda.so.{VERSION}": f"libcuda.so.{VERSION}"}

# each: how the driver is found (tmp root, its lib and bin dirs) -> (libraries by name -> file, binaries by name)
FIND_CASES: dict[str, tuple[Callable[[Path, Path, Path], NvidiaDriver], Callable[[NvidiaDriver], bool]]] = {
    "ldconfig lists it in a folder mounted below /usr (the H200 host): every name from its real file": (
        lambda root, lib, bin_: nvidia_driver(ldconfig=LDCONFIG.format(nv=lib, stale=root), arch="x86_64",
                                              lib_dirs=[], bin_dirs=[bin_]),
        lambda d: d.cuda and _names(d.libraries) == {"libcuda.so.1": f"libcuda.so.{VERSION}",
                                                     "libcuda.so": f"libcuda.so.{VERSION}",
                                                     "libnvidia-ml.so.1": f"libnvidia-ml.so.{VERSION}"}
        and _names(d.binaries) == {"nvidia-smi": "nvidia-smi"}),
    "not in the loader's cache (the host finds it by LD_LIBRARY_PATH): the usual folders": (
        lambda root, lib, bin_: nvidia_driver(ldconfig="", lib_dirs=[root / "absent", lib], bin_dirs=[bin_]),
        lambda d: d.cuda and _names(d.libraries) == {
            **CUDA_NAMES, "libnvidia-ml.so": f"libnvidia-ml.so.{VERSION}",
            "libnvidia-ml.so.1": f"libnvidia-ml.so.{VERSION}",
            f"libnvidia-ml.so.{VERSION}": f"libnvidia-ml.so.{VERSION}",
            "libnvidia-ptxjitcompiler.so": f"libnvidia-ptxjitcompiler.so.{VERSION}",
            "libnvidia-ptxjitcompiler.so.1": f"libnvidia-ptxjitcompiler.so.{VERSION}",
            f"libnvidia-ptxjitcompiler.so.{VERSION}": f"libnvidia-ptxjitcompiler.so.{VERSION}"}),
    "the loader's choice wins over a folder's copy of the same name": (
        lambda root, lib, bin_: nvidia_driver(ldconfig=LDCONFIG.format(nv=lib, stale=root), arch="x86_64",
                                              lib_dirs=[_copy(root, lib)], bin_dirs=[]),
        lambda d: dict(d.libraries)["libcuda.so.1"].endswith(f"/nvidia/lib64/libcuda.so.{VERSION}")),
    "a stale cache row (its file gone) is skipped, the next row of the name taken": (
        lambda root, lib, bin_: nvidia_driver(ldconfig=LDCONFIG.format(nv=root / "gone", stale=lib), arch="x86_64",
                                              lib_dirs=[], bin_dirs=[]),
        lambda d: not d.cuda and _names(d.libraries) == {"libnvidia-ml.so.1": f"libnvidia-ml.so.{VERSION}"}),
    "the operator's folders replace the search: the loader's cache is not read": (
        lambda root, lib, bin_: nvidia_driver([lib, bin_], ldconfig=LDCONFIG.format(nv=_copy(root, lib), stale=root)),
        lambda d: all(f"/nvidia/{'lib64' if n.startswith('lib') else 'bin'}/" in p
                      for n, p in d.libraries + d.binaries) and d.cuda and dict(d.binaries).keys() == {"nvidia-smi"}),
    "the operator's files, each by its own name": (
        lambda root, lib, bin_: nvidia_driver([lib / "libcuda.so.1", bin_ / "nvidia-smi"]),
        lambda d: _names(d.libraries) == {"libcuda.so.1": f"libcuda.so.{VERSION}"}
        and _names(d.binaries) == {"nvidia-smi": "nvidia-smi"}),
    "no driver on the host: nothing, and no CUDA": (
        lambda root, lib, bin_: nvidia_driver(ldconfig="", lib_dirs=[root / "absent"], bin_dirs=[root / "absent"]),
        lambda d: d == NvidiaDriver() and not d.cuda),
}


def _copy(root: Path, lib: Path) -> Path:
    """Another folder holding a libcuda.so.1 of its own."""
    other = root / "other"
    other.mkdir(exist_ok=True)
    (other / "libcuda.so.1").write_text("another")
    return other


@pytest.mark.parametrize("case", FIND_CASES.values(), ids=FIND_CASES.keys())
def test_nvidia_driver_is_found(case: tuple[Callable[..., NvidiaDriver], Callable[[NvidiaDriver], bool]],
                                tmp_path: Path) -> None:
    find, check = case
    lib, bin_ = _driver_folder(tmp_path)
    driver = find(tmp_path, lib, bin_)
    assert check(driver), driver


def _gpu_config(driver: NvidiaDriver, **kw: Any) -> dict[str, Any]:
    """The OCI config of a sandboxed transformers endpoint on an H200 class, as the local driver builds it."""
    launch = plan.endpoint(runtimes.REGISTRY["tensora-transformers"], VENV, "/data/files/alice/tiny", "wl_1", 42000,
                           "gpu", GPU, [0], Path("/data/replicas/r"), sandboxed=True, **kw)
    launch = plan.with_nvidia_driver(launch, driver)
    devices = [Device("/dev/nvidia0", 195, 0), Device("/dev/nvidiactl", 195, 255)]
    spec = plan.sandbox_spec(launch, "rp_1", 100_001, 100_001, plan.limits(GPU), devices, [(8700, 8720)])
    return oci_config(spec, HOST)


def _binds(config: dict[str, Any]) -> dict[str, tuple[str, list[str]]]:
    return {m["destination"]: (m["source"], m["options"]) for m in config["mounts"] if m["type"] == "bind"}


def _env(config: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in config["process"]["env"])


CONFIG_CASES: dict[str, Callable[[dict[str, Any], Path], bool]] = {
    "each library at /opt/nvidia/lib/<name>, from its real file, read-only, nosuid, nodev": lambda c, lib: all(
        _binds(c)[f"/opt/nvidia/lib/{name}"] == (str(lib / f"{real}"), ["bind", "ro", "nosuid", "nodev"])
        for name, real in CUDA_NAMES.items()),
    "nvidia-smi at /opt/nvidia/bin, read-only": lambda c, lib: _binds(c)["/opt/nvidia/bin/nvidia-smi"]
    == (str(lib.parent / "bin" / "nvidia-smi"), ["bind", "ro", "nosuid", "nodev"]),
    "nothing of the driver writable, nothing else of its folder shown": lambda c, lib: all(
        "ro" in opts for dst, (src, opts) in _binds(c).items() if dst.startswith("/opt/nvidia/"))
    and not any(src == str(lib) or src == str(lib.parent) for src, _ in _binds(c).values()),
    "the libraries first for the loader, the binaries first on PATH": lambda c, lib: _env(c)["LD_LIBRARY_PATH"]
    == "/opt/nvidia/lib" and _env(c)["PATH"].split(":")[:2] == ["/opt/nvidia/bin", "/opt/runtime/bin"],
    "its GPU's nodes allowed, and only its GPU shown to CUDA": lambda c, lib: {
        (d["path"], d["major"], d["minor"]) for d in c["linux"]["devices"]}
    == {("/dev/nvidia0", 195, 0), ("/dev/nvidiactl", 195, 255)} and _env(c)["CUDA_VISIBLE_DEVICES"] == "0",
    "transformers serve on CUDA, offline, never fetching Hub kernels (offline they fail the load)": lambda c, lib:
    c["process"]["args"][c["process"]["args"].index("--device") + 1] == "cuda"
    and _env(c)["USE_HUB_KERNELS"] == "NO" and _env(c)["HF_HUB_OFFLINE"] == "1",
    "the rest of the sandbox as before: the model and the runtime read-only": lambda c, lib:
    _binds(c)["/model"][0] == "/data/files/alice/tiny" and _binds(c)["/opt/runtime"][1][1] == "ro",
}


@pytest.mark.parametrize("check", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_a_gpu_sandbox_gets_the_driver(check: Callable[[dict[str, Any], Path], bool], tmp_path: Path) -> None:
    lib, bin_ = _driver_folder(tmp_path)
    config = _gpu_config(nvidia_driver(ldconfig="", lib_dirs=[lib], bin_dirs=[bin_]))
    assert check(config, lib), config


def test_a_gpu_replica_without_the_driver_fails_and_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(plan.LaunchError, match=r"libcuda\.so\.1.*nvidia_driver"):
        _gpu_config(nvidia_driver(ldconfig="", lib_dirs=[tmp_path], bin_dirs=[tmp_path]))


def test_the_operators_setting_reaches_the_local_driver(tmp_path: Path) -> None:
    from tensora.config.catalog import default_catalog
    from tensora.config.settings import ServeSettings
    from tensora.drivers.local import LocalDriver
    from tensora.serve import local_driver

    lib, bin_ = _driver_folder(tmp_path)
    settings = ServeSettings(data_dir=tmp_path / "data", driver="local", isolation="none",
                             node={"nvidia_driver": [str(lib), str(bin_)]})  # type: ignore[arg-type]
    driver = local_driver(settings, default_catalog())
    assert isinstance(driver, LocalDriver) and driver.nvidia_paths == (str(lib), str(bin_))
    assert driver._nvidia_driver().cuda and dict(driver._nvidia_driver().binaries).keys() == {"nvidia-smi"}
