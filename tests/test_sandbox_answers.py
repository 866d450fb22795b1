"""No answers inside the sandbox: no sandboxed program reads a reference solution, whatever the
mode and however megadiv is installed.

The megadiv package ships its datasets (MBPP with every reference program) as package data, so
the sandbox hides the package wherever it is installed: ``namespaces`` covers it with an empty
read-only tmpfs, ``unsafe`` grants Landlock read rights entry by entry around it. The probe
knows where the files are (the worst case: megadiv's source is public), walks every directory the
interpreter knows, and must find nothing; its control reads a file that is readable (for the wheel:
a sibling of the package in the same site-packages, so the files were hidden, not merely out of reach).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megadiv.data import DataConfig, load_dataset

ROOT_LINUX = sys.platform == "linux" and os.geteuid() == 0
REPO = Path(__file__).resolve().parents[1]
MODES = {"auto": dict(isolation="auto"), "unsafe": dict(isolation="unsafe"),
         "unsafe-os": dict(isolation="unsafe", audit_hook=False)}
pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(not ROOT_LINUX, reason="auto needs root on Linux")]

PROBE = """
import os, sys
PACKAGE, CONTROL, SNIPPETS = {package!r}, {control!r}, {snippets!r}

def holds_answers(path):
    try:
        with open(path, errors='replace') as f:
            text = f.read()
    except OSError:
        return False
    return any(s in text for s in SNIPPETS)

def attack():
    found = [p for p in (os.path.join(PACKAGE, 'data', 'files', 'mbpp', name)
                         for name in ('mbpp.jsonl', 'sanitized-mbpp.json')) if holds_answers(p)]
    for root in set(sys.path + [sys.prefix, sys.base_prefix, os.path.dirname(PACKAGE), PACKAGE]):
        for folder, dirs, files in os.walk(root or '.'):
            found += [os.path.join(folder, f) for f in files
                      if f.endswith(('.json', '.jsonl')) and holds_answers(os.path.join(folder, f))]
            if folder.count(os.sep) - root.count(os.sep) >= 4 and 'megadiv' not in folder:
                dirs.clear()  # deep inside other packages: no need to look
    print('found:', found)
    return found != []

def control():
    with open(CONTROL) as f:
        return len(f.read()) > 0
"""


def probe_source(package: str, control: str) -> str:
    mbpp = load_dataset(DataConfig(name="mbpp", split="test", max_items=20))
    snippets = [r.solution.strip().splitlines()[0] for r in mbpp if len(r.solution.strip().splitlines()[0]) > 20]
    return PROBE.format(package=package, control=control, snippets=snippets)


DRIVER = """
import json, sys
import megadiv
from megadiv.rewards import SandboxLimits, run_sandboxed
modes, source = json.loads(sys.stdin.read())
out = {"package": megadiv.__file__}
for mode, limits in modes.items():
    r = run_sandboxed(source, ["assert control()", "assert attack()"], 120.0, limits=SandboxLimits(**limits))
    out[mode] = [r.status, r.passed, r.detail, r.output[-3000:]]
print(json.dumps(out))
"""


def run_driver(python: str, package: str, control: str, env: dict) -> dict:
    proc = subprocess.run([python, "-c", DRIVER], input=json.dumps([MODES, probe_source(package, control)]),
                          capture_output=True, text=True, timeout=500, cwd="/", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(out: dict, package: str) -> None:
    assert os.path.dirname(out.pop("package")) == package
    for mode, (status, passed, detail, output) in out.items():
        # control() passed, attack() failed: the package's neighbours are readable, its data is not
        assert (status, passed) == ("failed", 1), (mode, detail, output)
        assert "found: []" in output, (mode, output)


def test_source_tree_answers_are_unreadable():
    """The package as the tests import it (a checkout on PYTHONPATH, like an editable install)."""
    import megadiv

    package = os.path.dirname(megadiv.__file__)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    check(run_driver(sys.executable, package, "/etc/passwd", env), package)


def test_wheel_install_answers_are_unreadable():
    """megadiv built as a wheel and installed into a venv (outside /tmp, world-readable like a real
    installation); the sandbox runs from that venv."""
    work = Path(tempfile.mkdtemp(prefix="megadiv-wheel-", dir="/var/tmp"))
    try:
        src = work / "src"
        shutil.copytree(REPO / "megadiv", src / "megadiv", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("setup.py", "README.md"):
            shutil.copy(REPO / name, src / name)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(work / "dist"), str(src)], check=True, timeout=300, capture_output=True)
        wheel = next((work / "dist").glob("megadiv-*.whl"))
        venv = work / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        site_packages = next(venv.glob("lib/python3*/site-packages"))
        # megadiv.rewards and megadiv.data need only the standard library: --no-deps is enough
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                        str(site_packages), str(wheel)], check=True, timeout=300, capture_output=True)
        for folder, _, _ in os.walk(work):
            os.chmod(folder, 0o755)
        package = str(site_packages / "megadiv")
        assert (site_packages / "megadiv" / "data" / "files" / "mbpp" / "mbpp.jsonl").is_file()
        control = str(next(site_packages.glob("megadiv-*.dist-info")) / "METADATA")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        check(run_driver(str(venv / "bin" / "python"), package, control, env), package)
    finally:
        shutil.rmtree(work, ignore_errors=True)


GIT_PROBE = """
import os, sys
try:
    import zlib
except ImportError:  # unsafe mode as root: the fresh uid may not read a private Python's lib-dynload
    zlib = None
LINE, TREES, KNOWN, CONTROL = {line!r}, {trees!r}, {known!r}, {control!r}

def read(path):
    try:
        with open(path, 'rb') as f:
            return f.read()
    except OSError:  # os.access would not do: Landlock refuses the open, not access(2)
        return None

def holds_line(path):
    data = read(path)
    if data is None:
        return False
    if LINE in data:
        return True
    if zlib is None:
        return False  # nothing under .git is readable either (checked for every file)
    try:
        return LINE in zlib.decompress(data)  # a loose git object
    except zlib.error:
        return False

def attack():
    # every file of the checkout's .git by name (its layout and object names follow from public
    # content), then whatever a walk of every tree finds
    found = [path for path in KNOWN if read(path) is not None]
    for root in set(TREES + sys.path + [sys.prefix, sys.base_prefix]):
        for folder, dirs, files in os.walk(root or '.'):
            for name in files:
                path = os.path.join(folder, name)
                if ('/.git/' in path and read(path) is not None) or holds_line(path):
                    found.append(path)
    print('found:', found[:20])
    return found != []

def control():
    with open(CONTROL) as f:
        return len(f.read()) > 0
"""


def test_editable_git_install_answers_are_unreadable():
    """``pip install -e git+...`` clones the project into ``<venv>/src/megadiv`` (inside the venv,
    a granted tree) with its .git; the venv imports the package from there. No file of any tree the
    program can walk holds a known MBPP reference line, as text or as a loose git object, and nothing
    under .git is readable; a sibling checkout in the same src/ stays readable."""
    work = Path(tempfile.mkdtemp(prefix="megadiv-editable-", dir="/var/tmp"))
    try:
        venv = work / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        project = venv / "src" / "megadiv"
        shutil.copytree(REPO / "megadiv", project / "megadiv", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("setup.py", "README.md"):
            shutil.copy(REPO / name, project / name)
        git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t"]
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "clone"]):
            subprocess.run(git + args, check=True, timeout=120, capture_output=True)
        (project / "megadiv" / "data" / "files" / "mbpp" / "mbpp.jsonl").unlink()  # left in .git only
        sibling = venv / "src" / "other" / "README"
        sibling.parent.mkdir()
        sibling.write_text("a sibling checkout")
        site_packages = next(venv.glob("lib/python3*/site-packages"))
        (site_packages / "megadiv.pth").write_text(str(project) + "\n")  # what an editable install adds
        for folder, _, _ in os.walk(work):
            os.chmod(folder, 0o755)
        line = load_dataset(DataConfig(name="mbpp", split="test"))[1].solution.splitlines()[1].strip()
        assert len(line) > 20 and line.encode() in (REPO / "megadiv/data/files/mbpp/mbpp.jsonl").read_bytes()
        known = [os.path.join(folder, name) for folder, _, names in os.walk(project / ".git") for name in names]
        source = GIT_PROBE.format(line=line.encode(), trees=[str(venv), str(project)], known=known,
                                  control=str(sibling))
        ns = {}
        exec(source, ns)  # outside the sandbox the same walk finds the line in .git and .git's files
        assert ns["attack"]() is True
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([str(venv / "bin" / "python"), "-c", DRIVER], input=json.dumps([MODES, source]),
                              capture_output=True, text=True, timeout=500, cwd="/", env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        check(json.loads(proc.stdout.strip().splitlines()[-1]), str(project / "megadiv"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


SECOND_COPY_PROBE = """
import os
def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        print('cannot read', path, type(e).__name__)
        return ''
"""


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_copy_in_a_second_site_packages_is_unreadable(mode, monkeypatch):
    """A copy of the package in another granted installation's site-packages (as the base
    interpreter's or a system dist-packages would hold one) is hidden like the one in use; a file
    beside it stays readable, so the probe can see that directory."""
    from megadiv.rewards import SandboxLimits, run_sandboxed, sandbox

    base = tempfile.mkdtemp(prefix="megadiv-second-site-", dir="/var/tmp")
    try:
        prefix = os.path.join(base, "prefix")
        site_dir = os.path.join(prefix, "lib", "python3.11", "site-packages")
        answers = os.path.join(site_dir, "megadiv", "data", "files")
        os.makedirs(answers)
        with open(os.path.join(answers, "answers.txt"), "w") as f:
            f.write("reference solutions\n")
        with open(os.path.join(site_dir, "neighbour.txt"), "w") as f:
            f.write("readable\n")
        for root, _, _ in os.walk(base):  # world-readable, as an installation is
            os.chmod(root, 0o755)
        granted = sandbox.python_paths()
        monkeypatch.setattr(sandbox, "python_paths", lambda: sorted({*granted, prefix}, key=len))
        assert os.path.join(site_dir, "megadiv") in sandbox.hidden_paths()
        tests = [f"assert read({os.path.join(answers, 'answers.txt')!r}) == 'reference solutions\\n'",
                 f"assert read({os.path.join(site_dir, 'neighbour.txt')!r}) == 'readable\\n'"]
        r = run_sandboxed(SECOND_COPY_PROBE, tests, 30.0, limits=SandboxLimits(**MODES[mode]))
        assert (r.status, r.passed) == ("failed", 1), r  # the neighbour read, the copy not
        assert "cannot read" in r.output and "neighbour" not in r.output, r.output
    finally:
        shutil.rmtree(base)
