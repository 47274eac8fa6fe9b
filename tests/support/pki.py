"""Test certificates, made with the openssl command: CAs and leaves signed by them."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return key, cert


def make_leaf(d: Path, name: str, ca: tuple[Path, Path], san: str) -> tuple[Path, Path]:
    key, csr, cert, ext = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt", d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n")
    subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                    "-keyout", str(key), "-out", str(csr)], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey",
                    str(ca[0]), "-CAcreateserial", "-days", "2", "-extfile", str(ext),
                    "-out", str(cert)], check=True, capture_output=True)
    return key, cert
