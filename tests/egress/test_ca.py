"""The deployment CA shared by egress proxies (egress.ca_dir), the bundle remote kernels trust
(`--write-ca-bundle`, egress.remote_ca_bundle), and the refusal of a secret rule on remote
kernels without that bundle. No packets: files, certificates, the session policy."""

from __future__ import annotations

import ssl
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cryptography import x509

from kernelmode.config import EgressNarrowing, EgressSettings
from kernelmode.egress.policy import session_policy
from kernelmode.egress.tls import Certificates
from kernelmode.errors import EgressRefused
from kernelmode.sandbox.egress import (
    CA_VARIABLES,
    ENV_CA,
    ENV_PROXY,
    ENV_TOKEN,
    environment,
    remote_environment,
)

REPO = Path(__file__).resolve().parents[2]


def test_processes_sharing_a_ca_dir_mint_from_one_ca(tmp_path: Path) -> None:
    # Replicas starting at once: one makes the CA under the lock, every other loads that one.
    with ThreadPoolExecutor(8) as pool:
        pems = set(pool.map(lambda _: Certificates(tmp_path / "ca").ca_pem(), range(8)))
    assert len(pems) == 1
    assert (tmp_path / "ca" / "ca-key.pem").stat().st_mode & 0o777 == 0o600
    # A leaf minted by one replica verifies against the CA another one loaded.
    ca = x509.load_pem_x509_certificate(Certificates(tmp_path / "ca").ca_pem())
    leaf = Certificates(tmp_path / "ca").server_context("secret.test")
    assert isinstance(leaf, ssl.SSLContext) and ca.subject.rfc4514_string().startswith("CN=kernelmode")


def test_a_ca_whose_key_is_not_its_own_is_refused(tmp_path: Path) -> None:
    a, b = Certificates(tmp_path / "a"), Certificates(tmp_path / "b")
    a.ca(), b.ca()
    (tmp_path / "a" / "ca-key.pem").write_bytes((tmp_path / "b" / "ca-key.pem").read_bytes())
    with pytest.raises(ValueError, match="is not the key of"):
        Certificates(tmp_path / "a").ca()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kernelmode.cli", "egress-proxy", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60)


def test_make_ca_then_write_ca_bundle(tmp_path: Path) -> None:
    ca_dir, bundle = tmp_path / "ca", tmp_path / "bundle.pem"
    r = cli("--ca-dir", str(ca_dir), "--write-ca-bundle", str(bundle))
    assert r.returncode == 2 and "--make-ca" in r.stderr and not bundle.exists()
    assert cli("--ca-dir", str(ca_dir), "--make-ca").returncode == 0
    r = cli("--ca-dir", str(ca_dir), "--make-ca")  # never replaced behind the kernels' back
    assert r.returncode == 2 and "already holds a CA" in r.stderr
    assert cli("--ca-dir", str(ca_dir), "--write-ca-bundle", str(bundle)).returncode == 0
    text = bundle.read_text()
    assert (ca_dir / "ca.pem").read_text().strip() in text and "PRIVATE KEY" not in text
    assert text.count("BEGIN CERTIFICATE") > 1  # the system's CAs too: it replaces the kernel's store
    assert bundle.stat().st_mode & 0o777 == 0o644


def test_remote_kernels_get_the_same_ca_variables_as_local_ones() -> None:
    launch = {"KERNEL_ID": "k1", ENV_TOKEN: "t" * 48, ENV_PROXY: "proxy:3128"}
    assert not set(CA_VARIABLES) & set(remote_environment(launch))
    env = remote_environment({**launch, ENV_CA: "/etc/kernelmode-egress-ca/ca-bundle.pem"})
    local = environment()
    assert {k for k in local if local[k].endswith(".pem")} == set(CA_VARIABLES)
    assert {k: env[k] for k in CA_VARIABLES} == dict.fromkeys(CA_VARIABLES, "/etc/kernelmode-egress-ca/ca-bundle.pem")


def test_a_secret_rule_on_remote_kernels_needs_remote_ca_bundle() -> None:
    settings = EgressSettings(allow=["api.example.com", "*.github.com"],
                              secrets=[{"host": "api.github.com", "header": "Authorization", "value": "x"}])
    asked = EgressNarrowing(allow=["api.github.com"])
    with pytest.raises(EgressRefused, match="egress.remote_ca_bundle"):
        session_policy(settings, "t", None, asked, remote=True)
    session_policy(settings, "t", None, asked)  # local kernels get the CA in their own bundle
    session_policy(settings, "t", None, EgressNarrowing(allow=["api.example.com"]), remote=True)  # no rule reachable
    settings.remote_ca_bundle = "/etc/kernelmode-egress-ca/ca-bundle.pem"
    assert session_policy(settings, "t", None, asked, remote=True).secrets
    with pytest.raises(ValueError, match="absolute path"):
        EgressSettings(remote_ca_bundle="/etc/../ca.pem")
