"""Packages on demand, the parts that need no server: requirement parsing, allow/deny rules, the
tenant rate, the pip command line (the kernel's target, wheels only), pip's failures mapped to
errors, the hash-checked cache and the unpacking of wheels into a layer."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import pytest

from kernelmode.errors import (
    InvalidRequest,
    NoWheel,
    PackageFetchFailed,
    PackageRefused,
    QuotaExceeded,
)
from kernelmode.kernel import preamble
from kernelmode.packages.cache import WheelCache
from kernelmode.packages.fetch import FetchOptions, _explain, pip_argv
from kernelmode.packages.layer import PackageLayer
from kernelmode.packages.policy import PackagePolicy, TenantRate, parse_requirement
from kernelmode.packages.target import KernelTarget
from kernelmode.sandbox import spec
from kernelmode.sandbox.bwrap_command import bwrap_argv
from tests.support.package_index import build_wheel

TARGET = KernelTarget("3.11", "cp", "cp311", ("manylinux_2_36_x86_64", "manylinux_2_17_x86_64", "linux_x86_64"),
                      {"tornado": ("tornado", "6.6.1")})


@pytest.mark.parametrize("text", ["requests", "numpy==2.1", "pandas>=2,<3", "rich[jupyter]", "Foo_Bar",
                                  "zope.interface~=5.0", "backports.tarfile", "foo.zip-utils"])
def test_requirements_from_the_index_are_accepted(text: str) -> None:
    assert parse_requirement(text).name


@pytest.mark.parametrize("text", ["", " ", "x; python_version<'3'", "a" * 201, "not valid!"])
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_requirement(text)


@pytest.mark.parametrize("text", ["-e .", "--index-url=http://x", "x @ https://e.com/x.whl", "./local", "/abs/path",
                                  "C:\\x", ".", "..", "file:x", "x-1.0.tar.gz", "X-1.0.TGZ", "x-1.0.zip[a]",
                                  "x-1.0-py3-none-any.whl", "x-1.0.tar.bz2==1", "x-1.0.tar#egg=x",
                                  "x-1.0.tar.gz; os_name=='posix'"])
def test_what_pip_could_read_as_a_path_url_option_or_archive_is_refused(text: str) -> None:
    with pytest.raises(PackageRefused) as e:
        parse_requirement(text)
    assert e.value.details["rule"] == "index_names_only"


def test_deny_by_name_glob_and_version() -> None:
    policy = PackagePolicy.from_lists(None, ["Evil_Pkg", "crypto-*", "requests<2"])
    for name, version in [("evil-pkg", None), ("EVIL.PKG", "1.0"), ("crypto-miner", "3"), ("requests", "1.9")]:
        with pytest.raises(PackageRefused) as e:
            policy.check(name, version)
        assert e.value.details["rule"].startswith("deny: ")
    policy.check("requests", "2.31")  # outside the denied versions
    policy.check("cryptography", "42")


def test_allow_list_names_and_versions() -> None:
    policy = PackagePolicy.from_lists(["tabulate", "numpy<3", "django-*"], [])
    policy.check("tabulate")
    policy.check("numpy", "2.1")
    policy.check("django-extensions", "3.2")
    with pytest.raises(PackageRefused, match="not in packages.allow"):
        policy.check("requests")
    with pytest.raises(PackageRefused, match="outside the versions"):
        policy.check("numpy", "3.0")


def test_tenant_rate() -> None:
    rate = TenantRate(2)
    rate.take("a")
    rate.take("a")
    rate.take("b")  # per tenant
    with pytest.raises(QuotaExceeded) as e:
        rate.take("a")
    assert e.value.details["retry_after_seconds"] >= 1


def test_pip_downloads_wheels_for_the_kernels_target_only(tmp_path: Path) -> None:
    argv = pip_argv(tmp_path / "d", ["kmtest-app==1.0"], TARGET, tmp_path / "c.txt",
                    FetchOptions("http://127.0.0.1:1/simple", ("http://127.0.0.1:2/simple",), 10, 5))
    assert argv[:6] == [sys.executable, "-I", "-m", "pip", "download", "--isolated"]
    joined = " ".join(argv)
    assert "--only-binary :all:" in joined
    assert "--python-version 3.11" in joined and "--abi cp311" in joined and "--implementation cp" in joined
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--platform"] == list(TARGET.platforms)
    assert "--constraint" in argv and "--index-url" in argv and "--extra-index-url" in argv
    assert argv[-2:] == ["--", "kmtest-app==1.0"]  # requirements can never be read as options
    assert "install" not in argv and "--no-binary" not in joined


def test_pips_failures_become_errors() -> None:
    assert isinstance(_explain("ERROR: No matching distribution found for foo\n", TARGET), NoWheel)
    conflict = _explain("ERROR: Cannot install x because these package versions have conflicting dependencies.\n"
                        "    x 1.0 depends on tornado<5\n    The user requested (constraint) tornado==6.6.1\n"
                        "ERROR: ResolutionImpossible", TARGET)
    assert isinstance(conflict, PackageRefused) and "tornado<5" in conflict.message
    assert isinstance(_explain("ERROR: Could not fetch URL: connection refused", TARGET), PackageFetchFailed)


def test_the_cache_checks_the_hash(tmp_path: Path) -> None:
    cache = WheelCache(tmp_path / "cache")
    staging = cache.staging()
    wheel = cache.add(build_wheel(staging, "kmtest-lib", "1.0", {"kmtest_lib/__init__.py": b"V = 1\n"}))
    assert cache.path(wheel).is_file()
    cache.remember("k", [wheel])
    assert cache.lookup("k") == [wheel]
    with open(cache.path(wheel), "ab") as f:
        f.write(b"tampered")
    with pytest.raises(PackageFetchFailed, match="sha256"):
        cache.path(wheel)
    assert cache.lookup("k") is None  # the bad file is gone: the next install downloads anew


def test_unpacking_a_wheel(tmp_path: Path) -> None:
    layer = PackageLayer(tmp_path / "layer")
    layer.create()
    pure = build_wheel(tmp_path, "kmtest-app", "1.0", {"ns/app/__init__.py": b"A = 1\n"}, ["kmtest-lib"])
    plat = build_wheel(tmp_path, "kmtest-native", "2.0", {"ns/native/__init__.py": b"N = 1\n"},
                       tag="cp311-cp311-manylinux_2_17_x86_64", purelib=False)
    layer.unpack(pure, 1 << 20)
    layer.unpack(plat, 1 << 20)
    assert (layer.site / "ns" / "app" / "__init__.py").is_file()
    assert (layer.site / "ns" / "native" / "__init__.py").is_file()  # from .data/platlib, namespace merged
    assert not any(p.name.endswith(".data") for p in layer.site.iterdir())
    assert layer.installed() == {"kmtest-app": ("kmtest-app", "1.0"), "kmtest-native": ("kmtest-native", "2.0")}
    assert (layer.site / "kmtest_app-1.0.dist-info" / "INSTALLER").read_text() == "kernelmode\n"
    assert not list(layer.root.glob(".staging-*"))


@pytest.mark.parametrize("member", ["../escape.py", "/abs.py", "a/../../escape.py", "a\\..\\b.py"])
def test_unsafe_members_are_refused_before_anything_is_installed(tmp_path: Path, member: str) -> None:
    layer = PackageLayer(tmp_path / "layer")
    layer.create()
    wheel = build_wheel(tmp_path, "kmtest-bad", "1.0", {"kmtest_bad.py": b"X = 1\n"})
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr(member, b"bad\n")
    with pytest.raises(PackageRefused) as e:
        layer.unpack(wheel, 1 << 20)
    assert e.value.details["rule"] == "wheel_format"
    assert list(layer.site.iterdir()) == []
    assert not (tmp_path / "escape.py").exists()


def test_links_and_zip_bombs_are_refused(tmp_path: Path) -> None:
    layer = PackageLayer(tmp_path / "layer")
    layer.create()
    wheel = build_wheel(tmp_path, "kmtest-link", "1.0", {"kmtest_link.py": b"X = 1\n"})
    with zipfile.ZipFile(wheel, "a") as zf:
        info = zipfile.ZipInfo("kmtest_link_evil")
        info.external_attr = (0o120777 << 16)
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(PackageRefused, match="symbolic link"):
        layer.unpack(wheel, 1 << 20)
    bomb = build_wheel(tmp_path, "kmtest-bomb", "1.0", {"kmtest_bomb.bin": bytes(2 << 20)})
    with pytest.raises(PackageRefused, match="unpacks to more than"):
        layer.unpack(bomb, 1 << 20)
    assert list(layer.site.iterdir()) == []


def test_the_layer_is_mounted_read_only_and_named_alike_on_both_sides(tmp_path: Path) -> None:
    argv = bwrap_argv(bwrap="bwrap", kernel_dir=tmp_path / "k", etc_dir=tmp_path / "etc", workspace=tmp_path / "w",
                      ro_paths=[], tmp_bytes=1, env={}, command=["python"], packages=tmp_path / "layer")
    i = argv.index(str(tmp_path / "layer"))
    assert argv[i - 1:i + 2] == ["--ro-bind", str(tmp_path / "layer"), spec.PACKAGES_MOUNT]
    assert argv.index("--remount-ro") > i
    params = spec.KernelParams(tmp_path, spec.Limits(), "s", tmp_path / "layer")
    env = params.to_env()
    assert spec.KernelParams.pop_from_env(env, spec.Limits()) == params and env == {}


def test_pip_magic_refuses_anything_but_install() -> None:
    for line in ("", "uninstall x", "install", "install -e .", "install --index-url http://x y", "download x"):
        with pytest.raises(preamble.ToolError, match="only `pip install"):
            preamble.pip_magic(line)


def test_the_probe_runs_with_the_kernels_python() -> None:
    """The target comes from the kernel's interpreter, not the manager's (read here for this one)."""
    import json
    import subprocess

    from kernelmode.packages.target import PROBE

    out = json.loads(subprocess.run([sys.executable, "-I", "-c", PROBE], capture_output=True, text=True,
                                    check=True).stdout)
    t = KernelTarget.from_probe(out)
    assert t.python == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert t.platforms[-1].startswith("linux_") and os.uname().machine in t.platforms[0]
    assert "pip" in t.dists


def test_a_layer_records_its_wheels_one_per_distribution(tmp_path: Path) -> None:
    layer = PackageLayer(tmp_path / "layer")
    layer.create()
    assert layer.wheels() == []
    layer.record({"name": "Kmtest_App", "version": "1.0", "filename": "a-1.0.whl", "sha256": "1" * 64, "size": 3})
    layer.record({"name": "kmtest-lib", "version": "1.0", "filename": "l-1.0.whl", "sha256": "2" * 64, "size": 3})
    layer.record({"name": "kmtest-app", "version": "2.0", "filename": "a-2.0.whl", "sha256": "3" * 64, "size": 3})
    assert [(w["name"], w["version"]) for w in layer.wheels()] == [("kmtest-lib", "1.0"), ("kmtest-app", "2.0")]
    assert not (layer.site / "wheels.json").exists()  # beside the mounted directory, not in it
    (layer.root / "wheels.json").write_text("{not json")
    assert layer.wheels() == []
