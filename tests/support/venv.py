"""A fresh virtual environment that sees the packages of the interpreter running the tests.

`python -m venv --system-site-packages` would not do: run from inside a virtual environment it
sees the *base* interpreter's site-packages, not the environment's (venvs do not chain), so a
user who installed torch into their own venv gets a fresh one without torch. Instead the new
environment gets no packages of its own and one `.pth` file naming every site-packages
directory of this interpreter (its venv's and, where that venv sees them, the base's), after
its own site-packages: what is installed into it comes first, the rest is found behind.
`--without-pip` because pip is found the same way, and creating one costs a second."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PTH_NAME = "_allocwatch_tests_outer_site.pth"


# Printed by the interpreter whose packages the new environment is to see.
SITE_DIRECTORIES = """
import os, site
found = list(site.getsitepackages())
if site.ENABLE_USER_SITE:
    found.append(site.getusersitepackages())
print("\\n".join(d for d in dict.fromkeys(found) if os.path.isdir(d)))
"""


def make_venv(target: Path, python: str = sys.executable) -> Path:
    """Creates a virtual environment at `target` from `python` and returns its interpreter; it
    sees `python`'s packages."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(target)], check=True,
                   timeout=120)
    interpreter = target / "bin" / "python"
    own = subprocess.run([str(interpreter), "-c", "import sysconfig; "
                          "print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    outer = subprocess.run([python, "-c", SITE_DIRECTORIES], capture_output=True, text=True,
                           check=True, timeout=60).stdout
    (Path(own) / PTH_NAME).write_text(outer)
    return interpreter
