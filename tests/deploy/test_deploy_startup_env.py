"""The start-up hook enabled through the environment alone: where a container's command cannot be
rewritten (the admission policies, the kustomize Component), `ALLOCWATCH_RUN=1` does what
`allocwatch run --` does. A `.pth` file installed beside the packages puts `allocwatch run`'s
start-up folder first on the path when, and only when, the variable asks; the hook itself is
the same one `allocwatch run` uses (allocator_ext/_autostart/sitecustomize.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from support.paths import REPO

PTH = REPO / "allocator_ext" / "_autostart" / "allocwatch_autostart.pth"
HOOK = REPO / "allocator_ext" / "_autostart" / "sitecustomize.py"
WHICH_HOOK = (
    "import sys; m = sys.modules.get('sitecustomize'); "
    "print(getattr(m, '__file__', None)); "
    "print(sum(p.endswith('_autostart') for p in sys.path))"
)


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ALLOCWATCH_")}
    clean.pop("PYTHONPATH", None)
    # ALLOCWATCH_ALLOCATOR=0: the hook's own work (torch, the agent) is not what is tested here.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**clean, "ALLOCWATCH_ALLOCATOR": "0", **env}, timeout=120,
                          cwd=Path(sysconfig.get_paths()["purelib"]))


def test_the_pth_file_is_installed_beside_the_packages() -> None:
    installed = [Path(p) / PTH.name for p in sys.path if (Path(p) / PTH.name).is_file()]
    assert installed, f"{PTH.name} is in no site directory: reinstall (pip install -e .)"
    assert installed[0].read_text() == PTH.read_text()
    # site executes a .pth line only when it starts with "import" and is one line
    assert PTH.read_text().startswith("import ") and PTH.read_text().count("\n") == 1


def test_the_wheel_a_training_image_installs_carries_the_start_up(tmp_path: Path) -> None:
    """A trainer image's `pip install` of the wheel (docs/deploy.md#the-training-image) is all
    that ALLOCWATCH_RUN=1 needs: the .pth file at the wheel's root, which pip puts in
    site-packages, and the hook inside the package."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = tmp_path.glob("allocwatch-*.whl")
    with zipfile.ZipFile(wheel) as contents:
        assert contents.read(PTH.name) == PTH.read_bytes()
        assert contents.read("allocator_ext/_autostart/sitecustomize.py") == HOOK.read_bytes()


def test_without_the_variable_nothing_changes() -> None:
    out = python(WHICH_HOOK)
    assert out.returncode == 0, out.stderr
    hook, on_path = out.stdout.split()
    assert hook != str(HOOK) and on_path == "0"
    assert out.stderr == ""


def test_the_variable_enables_the_same_hook_as_allocwatch_run() -> None:
    out = python(WHICH_HOOK, ALLOCWATCH_RUN="1")
    assert out.returncode == 0, out.stderr
    hook, on_path = out.stdout.split()
    assert Path(hook).resolve() == HOOK.resolve() and on_path == "1"


def test_under_allocwatch_run_as_well_the_hook_is_on_the_path_once() -> None:
    out = python(f"import os; os.execv({sys.executable!r}, [{sys.executable!r}, '-m', "
                 f"'exporter.cli', 'run', '--', {sys.executable!r}, '-c', {WHICH_HOOK!r}])",
                 ALLOCWATCH_RUN="1")
    assert out.returncode == 0, out.stderr
    hook, on_path = out.stdout.split()
    assert Path(hook).resolve() == HOOK.resolve() and on_path == "1"


def test_reached_by_two_paths_the_hook_is_on_the_path_once_and_runs_once(tmp_path: Path) -> None:
    """`allocwatch run` puts the folder's resolved path on PYTHONPATH; the .pth file adds the
    path its site directory gives, which differs where a symlink leads there. Either way one
    hook: it must not chain to itself, and a site's own sitecustomize still runs, once."""
    link = tmp_path / "elsewhere" / "_autostart"
    link.parent.mkdir()
    link.symlink_to(HOOK.parent, target_is_directory=True)
    site_own = tmp_path / "site"
    site_own.mkdir()
    (site_own / "sitecustomize.py").write_text("print('the site\\'s own')\n")
    code = (WHICH_HOOK + "; print(sum(type(f).__name__ == '_AfterTorchImport' "
            "for f in sys.meta_path))")
    out = python(code, ALLOCWATCH_RUN="1",
                 PYTHONPATH=os.pathsep.join([str(link), str(site_own)]))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    site_line, hook, on_path, finders = out.stdout.split("\n")[:4]
    assert site_line == "the site's own" and Path(hook).resolve() == HOOK.resolve()
    assert (on_path, finders) == ("1", "1"), out.stdout


def test_the_line_cannot_fail_where_the_package_is_not_found() -> None:
    """A broken or half-removed install must never stop the interpreter or print a line."""
    code = (
        "import os, sys\n"
        "sys.path[:] = [p for p in sys.path if 'site-packages' not in p and p]\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__]\n"
        "before = list(sys.path)\n"
        "def addpackage(line):\n"  # site runs the line inside a function: its scope rules
        "    exec(line)\n"
        f"addpackage(open({str(PTH)!r}).read())\n"
        "print(sys.path == before)\n"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env={"ALLOCWATCH_RUN": "1", "PATH": os.environ["PATH"]}, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "True" and out.stderr == "", out
