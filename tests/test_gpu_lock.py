"""The GPU tier's install: requirements-gpu.txt, setup.py's bounds and docker/Dockerfile agree with
each other and with what the pinned packages declare in their own metadata.

Method (why not ``pip install --dry-run --report``): PyPI publishes no separate metadata file for
most of these uploads, so pip's resolver would download whole wheels (torch's CUDA build is
0.5 GB, Transformer Engine's core 180-276 MB) and could not resolve the sdist-only packages
(DeepSpeed, TE's torch extension) without building them. tests/pypi_metadata.py instead reads
each pinned file's METADATA with HTTP range requests (a few kB per wheel) and small sdists' PKG-INFO,
cached in $MEGADIV_CACHE/pypi-metadata: the first run reads 24 files (3.5 MB, the DeepSpeed sdist
most of it) in 16 s, a rerun reads none and takes 3 s (2026-12-02, 2 busy cores, pytest included). Needs PyPI (CI reaches it); fails, naming the package, when it cannot read one.
"""
from __future__ import annotations

import ast
import re
import shutil
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests import pypi_metadata as pm

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements-gpu.txt"
DOCKERFILE = REPO / "docker" / "Dockerfile"
# The GPU machine's environment markers (Linux x86_64, CPython 3.12).
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}
# Declared relations the lock exists for; each must have been checked (the test is not vacuous).
KEY_RELATIONS = {("sglang", "torch"), ("sglang", "transformers"), ("sglang", "tokenizers"),
                 ("megatron-core", "torch"), ("megatron-core", "transformer-engine"), ("deepspeed", "torch"),
                 ("transformers", "tokenizers"), ("transformer-engine", "transformer-engine-torch"),
                 ("transformer-engine", "transformer-engine-cu13"), ("transformer-engine-torch", "torch")}


def read_lock(path: Path = LOCK) -> dict[str, Requirement]:
    reqs = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            reqs[canonicalize_name(req.name)] = req
    return reqs


def pinned_version(req: Requirement) -> Version | None:
    specs = list(req.specifier)
    exact = len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version
    return Version(specs[0].version) if exact else None


def setup_requirements() -> tuple[dict[str, Requirement], dict[str, Requirement]]:
    """setup.py's install_requires and its ``gpu`` extra, read from its source (not executed)."""
    call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    core = [Requirement(r) for r in ast.literal_eval(kw["install_requires"])]
    gpu = [Requirement(r) for r in ast.literal_eval(kw["extras_require"])["gpu"]]
    return ({canonicalize_name(r.name): r for r in core}, {canonicalize_name(r.name): r for r in gpu})


def declared(name: str, version: Version) -> tuple[list[Requirement], bool]:
    """(Requires-Dist, whether they come from an sdist that computes them when it is built)."""
    file = pm.pick_file(pm.release_files(name), name, str(version))
    reqs, dynamic = pm.requirements(pm.core_metadata(file))
    return reqs, dynamic and not file["filename"].endswith(".whl")   # a wheel's metadata is final


def applies(req: Requirement, extras: set[str]) -> bool:
    """Whether ``req`` holds on the GPU machine when its package is installed with ``extras``."""
    return req.marker is None or any(req.marker.evaluate({**MARKER_ENV, "extra": e}) for e in {"", *extras})


def marker_extras(req: Requirement) -> set[str]:
    return {canonicalize_name(e) for e in re.findall(r'extra == "([^"]+)"', str(req.marker or ""))}


def test_lock_pins_agree_with_every_pinned_packages_declared_requirements():
    lock = read_lock()
    pins = {name: v for name, req in lock.items() if (v := pinned_version(req)) is not None}
    extras = {name: {canonicalize_name(e) for e in req.extras} for name, req in lock.items()}
    todo, checked, violations, dynamic = list(pins), set(), [], []
    while todo:
        name = todo.pop(0)
        reqs, is_dynamic = declared(name, pins[name])
        if is_dynamic:
            dynamic.append(name)
        for req in reqs:
            dep = canonicalize_name(req.name)
            # a package an extra of the lock pins exactly (TE's [pytorch] -> transformer-engine-torch
            # ==2.11.0) is part of the environment: its own requirements are checked too
            asked = marker_extras(req) & extras.get(name, set())
            if dep not in pins and asked and applies(req, asked) and (v := pinned_version(req)):
                pins[dep], extras[dep] = v, {canonicalize_name(e) for e in req.extras}
                todo.append(dep)
            # every declared range on a pinned package counts, behind any extra too: it is the
            # package's word on what it works with (megatron-core states its TE range in 'dev')
            if dep in pins and applies(req, marker_extras(req)):
                checked.add((name, dep))
                if not req.specifier.contains(pins[dep], prereleases=True):
                    violations.append(f"{name}=={pins[name]} requires {req} but the lock has {dep}=={pins[dep]}")
    assert not violations, "\n".join(violations)
    assert KEY_RELATIONS <= checked, sorted(KEY_RELATIONS - checked)
    # sdists whose requirements are computed when they are built (PKG-INFO holds the release's build)
    assert set(dynamic) <= {"deepspeed", "transformer-engine-torch"}, dynamic


def test_setup_py_bounds_admit_only_the_tested_versions():
    """``pip install -e .[gpu]`` cannot pick a megatron-core, Transformer Engine or SGLang outside
    what the lock pins and megatron-core declares, whatever has been released since."""
    core, gpu = setup_requirements()
    lock = read_lock()
    for name, req in {**core, **gpu}.items():
        if name in lock and (v := pinned_version(lock[name])) is not None:
            assert req.specifier.contains(v, prereleases=True), f"setup.py {req} excludes the lock's {lock[name]}"
    admitted = {name: [v for v in pm.released_versions(name) if req.specifier.contains(v, prereleases=True)]
                for name, req in {**core, **gpu}.items() if name in ("megatron-core", "transformer-engine", "sglang")}
    assert admitted["megatron-core"] == [Version("0.16.1")]
    assert admitted["sglang"] == [Version("0.5.23")]
    te_range = next(r for r in declared("megatron-core", Version("0.16.1"))[0]
                    if canonicalize_name(r.name) == "transformer-engine").specifier
    assert admitted["transformer-engine"], "setup.py admits no released Transformer Engine"
    outside = [str(v) for v in admitted["transformer-engine"] if not te_range.contains(v, prereleases=True)]
    assert not outside, f"setup.py admits TE {outside}, outside megatron-core 0.16.1's declared {te_range}"
    assert set(gpu["transformer-engine"].extras) == set(lock["transformer-engine"].extras)


# --------------------------------------------------------------------------- docker/Dockerfile

INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "LABEL", "SHELL", "CMD", "ENTRYPOINT", "USER",
                "EXPOSE", "ADD", "VOLUME", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD"}


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):          # comment inside a continued RUN
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        word, _, args = current.strip().partition(" ")
        out.append((word.upper(), args.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return out


def test_dockerfile_parses_and_installs_the_lock():
    steps = dockerfile_instructions(DOCKERFILE.read_text())
    words = [w for w, _ in steps]
    assert set(words) <= INSTRUCTIONS, set(words) - INSTRUCTIONS
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in steps if w == "ARG" and "=" in a}
    assert words.index("FROM") > 0 and all(w == "ARG" for w in words[:words.index("FROM")])
    base = next(a for w, a in steps if w == "FROM").replace("${BASE}", args.get("BASE", ""))
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), base
    for w, a in steps:
        if w == "COPY":
            for src in a.split()[:-1]:
                if not src.startswith("--"):
                    assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    run = "\n".join(a for w, a in steps if w == "RUN")
    assert "requirements-gpu.txt" in run
    # no version written into the Dockerfile other than the lock's: every name==version (and the
    # TE range it checks the base image against) must be the lock's / setup.py's, so they cannot drift
    lock = read_lock()
    for name, version in re.findall(r"([A-Za-z][\w.\-]*)==(\d[\w.]*)", DOCKERFILE.read_text()):
        key = canonicalize_name(name)
        assert key in lock and pinned_version(lock[key]) == Version(version), \
            f"docker/Dockerfile pins {name}=={version}; requirements-gpu.txt has {lock.get(key)}"
    te_range = setup_requirements()[1]["transformer-engine"].specifier
    assert args.get("TE_RANGE") == str(te_range), (args.get("TE_RANGE"), str(te_range))


def test_lock_reader_and_docker_parser_catch_drift(tmp_path):
    """The checks above fail when they should: a pin the Dockerfile does not share, a continuation
    that never ends."""
    with pytest.raises(AssertionError, match="ends inside"):
        dockerfile_instructions("FROM x\nRUN a \\\n")
    steps = dockerfile_instructions("ARG BASE=a\nFROM ${BASE}\n# note\nRUN pip install \\\n  # why\n  x==1\n")
    assert steps == [("ARG", "BASE=a"), ("FROM", "${BASE}"), ("RUN", "pip install    x==1")]
    lock = tmp_path / "lock.txt"
    lock.write_text("torch==2.14.1  # note\nnumpy>=1.26,<3\n\n")
    reqs = read_lock(lock)
    assert pinned_version(reqs["torch"]) == Version("2.14.1") and pinned_version(reqs["numpy"]) is None


NGC_CONSTRAINTS = REPO / "tests" / "fixtures" / "ngc-25.12-constraint.txt"   # its source is named inside


def _pip_steps(tmp_path: Path) -> list[tuple[str, list[Path]]]:
    """Each ``pip install -r`` of the Dockerfile's RUN steps: (the command, its requirement files),
    the files made by running the step's own ``grep ... requirements-gpu.txt > /tmp/X`` commands
    on the lock (their /tmp moved to ``tmp_path``)."""
    import subprocess

    run = " && ".join(a for w, a in dockerfile_instructions(DOCKERFILE.read_text()) if w == "RUN")
    commands = [c.strip() for c in run.split(" && ")]
    for c in commands:
        if c.startswith("grep") and "requirements-gpu.txt" in c:
            subprocess.run(["bash", "-c", c.replace("/tmp/", f"{tmp_path}/")], cwd=REPO, check=True, timeout=30)
    steps = []
    for c in commands:
        if "pip install" in c and " -r " in c:
            files = [tmp_path / Path(f).name for f in re.findall(r"-r (\S+)", c)]
            steps.append((c, files))
    return steps


def test_dockerfile_pip_steps_resolve_under_the_base_images_constraints(tmp_path):
    """NGC's PIP_CONSTRAINT=/etc/pip/constraint.txt holds for every pip in the image, a venv's
    included. The same check the build runs (docker/check_constraints.py) on the same requirement
    files: the trainer's step leaves the image's torch/TE/apex lines out and passes; SGLang's venv
    step pins the lock's torch, which the image's constraint refuses, so it must clear
    PIP_CONSTRAINT. Then: one NCCL in both environments (the build compares them), and TF32
    override off."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_constraints", REPO / "docker" / "check_constraints.py")
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    keep = tmp_path / "keep.txt"          # what step 1's `pip list | grep` keeps, at the fixture's torch
    keep.write_text("torch==2.10.0a0+b4e4ee81d3\ntransformer_engine==2.10.0+769ed778\napex==0.1\n")
    steps = _pip_steps(tmp_path)
    assert [files[0].name for _, files in steps] == ["trainer.txt", "sglang.txt"]
    for command, files in steps:
        reqs = [r for f in files for r in cc.requirements(f)]
        assert reqs, command
        found = cc.conflicts(reqs, [NGC_CONSTRAINTS, keep])
        if command.startswith("PIP_CONSTRAINT= "):
            assert found, f"{command}: clears the image's constraints without needing to"
        else:
            assert not found, f"{command}: {found}"
    assert any("torch==2.14.1 vs torch==2.10.0a0+b4e4ee81d3" in c
               for c in cc.conflicts(cc.requirements(tmp_path / "sglang.txt"), [NGC_CONSTRAINTS]))
    trainer = {canonicalize_name(r.name) for r in cc.requirements(tmp_path / "trainer.txt")}
    assert not trainer & {"torch", "transformer-engine", "sglang"}
    # the build's own check runs before step 1's install, on the image's constraints and the kept versions
    text = DOCKERFILE.read_text()
    assert "python docker/check_constraints.py /tmp/trainer.txt ${PIP_CONSTRAINT:-/etc/pip/constraint.txt} " \
           "/tmp/keep.txt" in text
    assert text.index("check_constraints.py /tmp/trainer.txt") < text.index("pip install --no-cache-dir -c /tmp/keep.txt")
    # NCCL: the venv preloads the image's libnccl.so.2, and the build fails unless both report one version
    assert "megadiv_image_nccl.pth" in text and "ctypes.RTLD_GLOBAL" in text
    assert text.count("print(torch.cuda.nccl.version())") == 2 and "cmp -s /tmp/nccl.trainer /tmp/nccl.sglang" in text
    assert "ENV TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0" in text


def test_constraint_check_names_each_conflict(tmp_path):
    from subprocess import run

    reqs, constraints = tmp_path / "r.txt", tmp_path / "c.txt"
    reqs.write_text("numpy>=1.26,<2  # why\ntorch==2.14.1\nrequests>=2\n")
    constraints.write_text("# header\nnumpy==2.1.0\ntorch==2.10.0a0+b4e4ee81d3\nrequests==2.32.3\n")
    proc = run([sys.executable, str(REPO / "docker" / "check_constraints.py"), str(reqs), str(constraints),
                str(tmp_path / "absent.txt")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert f"numpy<2,>=1.26 vs numpy==2.1.0 ({constraints}:2)" in proc.stderr
    assert "torch==2.14.1 vs torch==2.10.0a0+b4e4ee81d3" in proc.stderr and "requests" not in proc.stderr
    ok = run([sys.executable, str(REPO / "docker" / "check_constraints.py"), str(reqs), str(tmp_path / "absent.txt")],
             capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


def test_the_build_checks_that_the_images_nccl_defines_what_torch_calls(tmp_path):
    """The SGLang venv binds torch 2.14.1's NCCL calls to the image's (older) NCCL, lazily: the build
    lists each torch library's undefined nccl* symbols and fails, naming them and what to do, when
    the image's library lacks one. Shown on two real shared objects built here: a 'torch' that calls
    ncclCommInitRankConfig and ncclCommShrink, and 'NCCL's' with and without the second."""
    from subprocess import run

    if shutil.which("cc") is None or shutil.which("nm") is None:
        pytest.skip("needs a C compiler and nm (binutils)")

    def shared_object(name: str, source: str) -> Path:
        (tmp_path / f"{name}.c").write_text(source)
        out = tmp_path / f"lib{name}.so"
        run(["cc", "-shared", "-fPIC", "-o", str(out), str(tmp_path / f"{name}.c")], check=True, timeout=120)
        return out

    torch_lib = shared_object("torchcuda", "int ncclCommInitRankConfig(void); int ncclCommShrink(void); int puts(const char*);\n"
                                           "int f(void) { puts(\"x\"); return ncclCommInitRankConfig() + ncclCommShrink(); }\n")
    older = shared_object("nccl228", "int ncclCommInitRankConfig(void) { return 0; }\n")
    newer = shared_object("nccl230", "int ncclCommInitRankConfig(void) { return 0; }\nint ncclCommShrink(void) { return 1; }\n")
    check = [sys.executable, str(REPO / "docker" / "check_nccl_symbols.py")]
    proc = run([*check, str(older), str(torch_lib)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{torch_lib} needs ncclCommShrink." in proc.stderr and "ncclCommInitRankConfig" not in proc.stderr
    assert "puts" not in proc.stderr and "rollout.sync_method tensor or disk" in proc.stderr
    ok = run([*check, str(newer), str(torch_lib)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    # the build runs it on every library of the SGLang venv's torch, after the preload; apex is optional
    text = DOCKERFILE.read_text()
    assert 'python docker/check_nccl_symbols.py "$NCCL_LIB" $(/opt/sglang/bin/python' in text
    assert text.index("megadiv_image_nccl.pth") < text.index("check_nccl_symbols.py \"$NCCL_LIB\"")
    assert "docker/check_nccl_symbols.py ./docker/" in text and "import apex" not in text
