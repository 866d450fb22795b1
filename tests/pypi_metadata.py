"""Declared requirements of released packages, read from PyPI without installing or downloading them.

    files = release_files("megatron-core")              # the simple index (PEP 691 JSON), every release
    text = core_metadata(pick_file(files, "megatron-core", "0.16.1"))   # its METADATA / PKG-INFO

A wheel's METADATA is read with HTTP range requests: the zip's end-of-central-directory record and
central directory (at the end of the file), then that one member, a few kilobytes in all, so a
276 MB CUDA wheel costs what a small one does (PyPI has no separate metadata file for most of
these uploads, and pip's ``--dry-run --report`` would download whole wheels for lack of it). A
package released only as an sdist (DeepSpeed, Transformer Engine's torch extension) is downloaded
whole when small (a few MB) and its PKG-INFO read. Everything read is cached under
``$MEGADIV_CACHE/pypi-metadata`` (default ~/.cache/megadiv), keyed by file name (a released file
never changes), so a second run needs no network.
"""
from __future__ import annotations

import io
import json
import os
import struct
import tarfile
import urllib.request
import zlib
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

INDEX = "https://pypi.org/simple"
TIMEOUT_S = 60
SDIST_MAX_BYTES = 16 * 2**20       # sdists are read whole: only small ones
# The GPU machine: CPython 3.12 on manylinux x86_64; a pure-Python wheel serves as well.
WHEEL_TAGS = ("cp312-cp312-manylinux", "py3-none-manylinux", "cp39-abi3-manylinux", "py3-none-any",
              "py2.py3-none-any")


def cache_dir() -> Path:
    path = Path(os.environ.get("MEGADIV_CACHE") or Path.home() / ".cache" / "megadiv") / "pypi-metadata"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _get(url: str, headers: dict | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=TIMEOUT_S) as r:
        if headers and "Range" in headers and r.status != 206:
            raise OSError(f"{url}: the server ignored the range request (HTTP {r.status})")
        return r.read()


def release_files(name: str) -> list[dict]:
    """The index's file list of ``name`` (PEP 691: filename, url, size, yanked), cached per day
    (new releases appear; the cache keeps a rerun offline within the day)."""
    import datetime

    path = cache_dir() / f"index-{canonicalize_name(name)}-{datetime.date.today().isoformat()}.json"
    if not path.exists():
        body = _get(f"{INDEX}/{canonicalize_name(name)}/", {"Accept": "application/vnd.pypi.simple.v1+json"})
        path.write_bytes(body)
    return json.loads(path.read_text())["files"]


def released_versions(name: str) -> list[Version]:
    versions = set()
    for f in release_files(name):
        if f.get("yanked"):
            continue
        fn = f["filename"]
        try:
            versions.add(parse_wheel_filename(fn)[1] if fn.endswith(".whl") else parse_sdist_filename(fn)[1])
        except ValueError:
            continue
    return sorted(versions)


def pick_file(files: list[dict], name: str, version: str) -> dict:
    """The file of ``name==version`` pip would install on the GPU machine: a cp312/pure x86_64
    wheel, else the sdist."""
    wanted = Version(version)
    wheels, sdists = [], []
    for f in files:
        fn = f["filename"]
        if fn.endswith(".whl"):
            if parse_wheel_filename(fn)[1] == wanted and any(t in fn for t in WHEEL_TAGS) \
                    and ("x86_64" in fn or fn.endswith("-any.whl")):
                wheels.append(f)
        elif fn.endswith(".tar.gz") and parse_sdist_filename(fn)[1] == wanted:
            sdists.append(f)
    if wheels:
        return wheels[0]
    if sdists:
        return sdists[0]
    raise LookupError(f"{name}=={version}: no cp312 x86_64 wheel and no sdist on {INDEX}")


def _range(url: str, start: int, end: int) -> bytes:
    return _get(url, {"Range": f"bytes={start}-{end}"})


def _wheel_metadata(url: str, size: int) -> str:
    """The wheel's ``*.dist-info/METADATA`` through range requests (zip layout: APPNOTE 4.3)."""
    tail = _range(url, max(0, size - 65536), size - 1)
    eocd = tail.rfind(b"PK\x05\x06")                     # end of central directory record
    if eocd < 0:
        raise OSError(f"{url}: no zip end-of-central-directory record in the last 64 KiB")
    cd_size, cd_offset = struct.unpack("<II", tail[eocd + 12:eocd + 20])
    directory = _range(url, cd_offset, cd_offset + cd_size - 1)
    pos = 0
    while pos + 46 <= len(directory):
        method, = struct.unpack("<H", directory[pos + 10:pos + 12])
        csize, _usize, nlen, elen, clen = struct.unpack("<IIHHH", directory[pos + 20:pos + 34])
        local_offset, = struct.unpack("<I", directory[pos + 42:pos + 46])
        member = directory[pos + 46:pos + 46 + nlen].decode()
        pos += 46 + nlen + elen + clen
        if member.count("/") == 1 and member.endswith(".dist-info/METADATA"):
            header = _range(url, local_offset, local_offset + 29)
            fname_len, extra_len = struct.unpack("<HH", header[26:30])
            start = local_offset + 30 + fname_len + extra_len
            data = _range(url, start, start + csize - 1)
            return (zlib.decompress(data, -15) if method == 8 else data).decode()
    raise OSError(f"{url}: no .dist-info/METADATA member")


def _sdist_metadata(url: str, size: int) -> str:
    if size > SDIST_MAX_BYTES:
        raise OSError(f"{url}: sdist of {size} bytes, over the {SDIST_MAX_BYTES} read whole")
    with tarfile.open(fileobj=io.BytesIO(_get(url)), mode="r:gz") as tar:
        top = min((m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")),
                  key=lambda m: m.name)
        return tar.extractfile(top).read().decode()


def core_metadata(file: dict) -> str:
    """The METADATA (wheel) or PKG-INFO (sdist) text of an index file entry, cached."""
    path = cache_dir() / (file["filename"] + ".METADATA")
    if not path.exists():
        size = file.get("size")
        if size is None:
            raise OSError(f"{file['filename']}: the index gives no size")
        read = _wheel_metadata if file["filename"].endswith(".whl") else _sdist_metadata
        path.write_text(read(file["url"], size))
    return path.read_text()


def requirements(metadata: str) -> tuple[list[Requirement], bool]:
    """(Requires-Dist, whether they are marked Dynamic: computed when the sdist is built)."""
    msg = Parser().parsestr(metadata)
    dynamic = any(v.strip().lower() == "requires-dist" for v in msg.get_all("Dynamic") or [])
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []], dynamic
