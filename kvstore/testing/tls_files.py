"""Self-signed TLS material for tests and local set-ups: a CA, a server certificate it
signed (SAN 127.0.0.1 and localhost) and a client certificate for mutual TLS.

Made with the ``openssl`` command (a clear ``TierError`` when it is missing or fails); used by
the Redis fixtures (``kvstore.testing.redis_proc``) and the store process's TLS tests.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import TierError


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """A self-signed CA, a server certificate it signed, and a client certificate for mTLS."""

    ca_cert: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


_LEAF_EXT = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = {eku}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
{san}
"""


def make_tls_files(directory: Path) -> TLSFiles:
    """Create CA, server and client certificates (EC P-256, 10 years) under ``directory``;
    the server certificate may also act as a client (the cluster bus does so)."""
    if shutil.which("openssl") is None:
        raise TierError("the 'openssl' command is not on PATH; it is needed to make TLS files")
    d = Path(directory).resolve()
    d.mkdir(parents=True, exist_ok=True)
    newkey = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        d,
        "req",
        "-x509",
        *newkey,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=kvstore-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    leaves = {
        "server": ("kvstore-test-server", "serverAuth, clientAuth", "subjectAltName = IP:127.0.0.1, DNS:localhost"),
        "client": ("kvstore-test-client", "clientAuth", ""),
    }
    for name, (cn, eku, san) in leaves.items():
        (d / f"{name}.ext").write_text(_LEAF_EXT.format(eku=eku, san=san))
        _openssl(d, "req", "-new", *newkey, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
        _openssl(
            d,
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-set_serial",
            str(random.getrandbits(63)),
            "-days",
            "3650",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.crt",
        )
    for key in ("ca.key", "server.key", "client.key"):
        os.chmod(d / key, 0o600)
    return TLSFiles(
        ca_cert=d / "ca.crt",
        cert=d / "server.crt",
        key=d / "server.key",
        client_cert=d / "client.crt",
        client_key=d / "client.key",
    )


def _openssl(cwd: Path, *args: str) -> None:
    try:
        done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise TierError(f"openssl {args[0]} failed in {cwd}: {err}") from err
    if done.returncode != 0:
        raise TierError(f"openssl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-800:]}")
