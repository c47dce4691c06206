"""Packaging: the wheel installs `fxpar` and nothing else, and every module imports from it.

Every package lives under `fxpar/` (one folder per concept, docs/architecture.md) and
setuptools finds them all (`[tool.setuptools.packages.find]`). This test
builds the wheel from the working tree, installs it into a fresh venv that sees the packages
of the environment running the test (torch, numpy, ... as a user with torch installed has them),
and checks that the venv imports every module from the wheel, not from the repository's
editable install.

[Note: the venv sees the running environment] `venv --system-site-packages` would show the
*base interpreter's* site-packages, which is not where torch is when the tests run inside a
venv (the README's setup) and which lacks it there. Instead a `.pth` file in the new venv lists
the running interpreter's site directories (`_site_directories`), so venv, conda and plain
system Python all work the same. The lines are plain paths: the running environment's own
`.pth` files (its editable fxpar among them) are not processed, and they come after the venv's
site-packages on sys.path, so the wheel is what `import fxpar` finds.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# In the venv's site-packages besides the wheel: the running environment's site directories.
RUNNING_ENVIRONMENT_PTH = "_fxpar_running_environment.pth"

# Junk that never belongs in the build's source copy (used when git is not available).
_IGNORED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".benchmarks",
    "runs", ".whl", ".venv", "*.pyc",
)

# Runs inside the venv: import fxpar and every submodule; write where each came from as JSON.
_IMPORT_ALL = r"""
import importlib, json, pkgutil, sys, sysconfig, traceback

failures = {}
import fxpar

names = ["fxpar"]
def onerror(name):
    failures[name] = traceback.format_exc()
for info in pkgutil.walk_packages(fxpar.__path__, "fxpar.", onerror=onerror):
    names.append(info.name)
    try:
        importlib.import_module(info.name)
    except BaseException:
        failures[info.name] = traceback.format_exc()
files = {name: getattr(sys.modules.get(name), "__file__", None) for name in names}
with open(sys.argv[1], "w") as out:
    json.dump({"purelib": sysconfig.get_paths()["purelib"], "files": files,
               "failures": failures}, out)
"""


def _env() -> dict[str, str]:
    """The environment minus anything that would put the repository on sys.path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE")}
    return env | {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def _site_directories() -> list[str]:
    """Where the running interpreter imports installed packages from, in sys.path order.

    `site.getsitepackages()` covers venvs (with the base's when the venv includes system
    site-packages), conda and distribution Pythons (`dist-packages`); sysconfig's purelib and
    platlib cover a scheme `site` does not list; the user site counts when it is enabled.
    Only directories on this interpreter's sys.path are kept: it uses exactly those.
    """
    candidates = [*site.getsitepackages(), sysconfig.get_paths()["purelib"],
                  sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    wanted = {os.path.realpath(c) for c in candidates if os.path.isdir(c)}
    ordered = []
    for entry in sys.path:
        real = os.path.realpath(entry or os.curdir)
        if real in wanted and real not in ordered:
            ordered.append(real)
    return ordered


def _run(command: list[str], what: str, cwd: Path, timeout: float = 300):
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=_env(),
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} took over {timeout:.0f} s: {' '.join(command)}")
    if done.returncode != 0:
        pytest.fail(f"{what} failed (exit {done.returncode}): {' '.join(command)}\n"
                    f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-6000:]}")
    return done


def _copy_source(dest: Path) -> None:
    """Copy the working tree (tracked and untracked-but-not-ignored files) to `dest`.

    Building from a copy leaves no `build/` or `*.egg-info` in the repository, and no stale
    file from an earlier `build/lib` can slip into the wheel.
    """
    listed = None
    if (REPO / ".git").exists() and shutil.which("git"):
        done = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                              cwd=REPO, capture_output=True)
        if done.returncode == 0:
            listed = [p for p in done.stdout.decode().split("\0") if p]
    if listed is None:
        shutil.copytree(REPO, dest, ignore=_IGNORED)
        return
    for rel in listed:
        source = REPO / rel
        if source.is_file():  # tracked but deleted in the working tree: skip
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Build the wheel, install it into a fresh venv that sees the running environment."""
    root = tmp_path_factory.mktemp("packaging")
    source, wheels, venv = root / "source", root / "wheels", root / "venv"
    _copy_source(source)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "-w", str(wheels), str(source)], "building the wheel", cwd=root)
    built = sorted(wheels.glob("fxpar-*.whl"))
    assert len(built) == 1, f"expected one fxpar wheel in {wheels}, found {[p.name for p in built]}"
    wheel = built[0]

    # --without-pip: the venv's site-packages starts empty, so afterwards it holds exactly what
    # the wheel installed, and the .pth file. pip itself comes from the running environment.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "creating the venv", cwd=root)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = _run([str(python), "-I", "-c", where], "asking the venv for its site-packages",
                   cwd=root).stdout.strip()
    # [Note: the venv sees the running environment]
    (Path(purelib) / RUNNING_ENVIRONMENT_PTH).write_text("\n".join(_site_directories()) + "\n")
    # --ignore-installed: the base environment's editable fxpar is neither uninstalled nor
    # taken as already satisfying the requirement.
    _run([str(python), "-I", "-m", "pip", "install", "--no-deps", "--ignore-installed", str(wheel)],
         "installing the wheel into the venv", cwd=root)

    report = root / "imports.json"
    script = root / "import_all.py"
    script.write_text(_IMPORT_ALL)
    # -I and cwd outside the repository: neither the repository nor PYTHONPATH is on sys.path.
    _run([str(python), "-I", str(script), str(report)], "importing fxpar in the venv", cwd=root)
    return {"wheel": wheel, "python": python, "source": source,
            "imports": json.loads(report.read_text())}


def _version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def test_wheel_holds_only_fxpar_at_top_level(installed):
    wheel = installed["wheel"]
    version = _version(wheel)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        record = archive.read(f"fxpar-{version}.dist-info/RECORD").decode()
    expected = {"fxpar", f"fxpar-{version}.dist-info"}
    top = {name.split("/")[0] for name in names}
    assert top == expected, (
        f"{wheel.name} has top-level entries {sorted(top - expected)} besides {sorted(expected)}: "
        "only `fxpar/` may be installed (check [tool.setuptools.packages.find])"
    )
    recorded = {line.split(",")[0].split("/")[0] for line in record.splitlines() if line}
    assert recorded == expected, f"RECORD lists top-level entries {sorted(recorded - expected)}"


def test_wheel_holds_every_source_module(installed):
    """Each .py under fxpar/ is in the wheel: a folder without an __init__.py, which
    `packages.find` would skip, fails here. The files are read from the copy the wheel was
    built from: a file someone adds to the working tree meanwhile is not a failure."""
    source = installed["source"]
    with zipfile.ZipFile(installed["wheel"]) as archive:
        in_wheel = set(archive.namelist())
    missing = [str(path.relative_to(source)) for path in sorted((source / "fxpar").rglob("*.py"))
               if "__pycache__" not in path.parts and path.relative_to(source).as_posix() not in in_wheel]
    assert not missing, "in the repository but not in the wheel (is its folder a package, with an __init__.py?):\n  " + "\n  ".join(missing)
    # The shipped hardware profiles are data (`fxpar.cost.profiles`): [tool.setuptools.package-data].
    profiles = [p.relative_to(source).as_posix() for p in sorted((source / "fxpar" / "cost" / "measured").glob("*.json"))]
    assert profiles and set(profiles) <= in_wheel, f"hardware profiles missing from the wheel: {set(profiles) - in_wheel}"


def test_venv_imports_every_module_from_the_wheel(installed):
    imports = installed["imports"]
    failures = imports["failures"]
    assert not failures, "modules that fail to import from the installed wheel:\n" + "\n".join(
        f"--- {name} ---\n{trace}" for name, trace in failures.items()
    )
    purelib = Path(imports["purelib"]).resolve()
    files = imports["files"]
    assert files["fxpar"] and Path(files["fxpar"]).resolve().is_relative_to(purelib), (
        f"the venv imported fxpar from {files['fxpar']}, not from the wheel installed in {purelib} "
        "(the base environment's editable install shadows it)"
    )
    outside = {name: file for name, file in files.items()
               if not file or not Path(file).resolve().is_relative_to(purelib)}
    assert not outside, f"modules not imported from the venv's site-packages {purelib}: {outside}"
    for package in ("fxpar.passes.tensor_parallel", "fxpar.cost", "fxpar.runtime.step"):
        assert package in files, f"{package} was not found walking the installed fxpar: {sorted(files)}"
    # Every module in the wheel was walked and imported.
    with zipfile.ZipFile(installed["wheel"]) as archive:
        in_wheel = {
            name[:-3].replace("/", ".").removesuffix(".__init__")
            for name in archive.namelist() if name.endswith(".py")
        }
    assert in_wheel <= set(files), f"modules in the wheel not imported: {sorted(in_wheel - set(files))}"


def test_venv_site_packages_holds_only_the_wheel(installed):
    purelib = Path(installed["imports"]["purelib"])
    version = _version(installed["wheel"])
    entries = {p.name for p in purelib.iterdir()}
    expected = {"fxpar", f"fxpar-{version}.dist-info", RUNNING_ENVIRONMENT_PTH}
    assert entries == expected, (
        f"the venv's site-packages {purelib} holds {sorted(entries)}; expected only {sorted(expected)}"
    )
