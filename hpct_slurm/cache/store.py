"""The per-node shared-memory data cache: build once per node, map everywhere.

A cache is a directory `<job shm dir>/<name>/` holding one `.npy` file per array and an
`index.json`. One local rank builds it under a filelock while the others wait; it is built in a
hidden temporary directory and renamed into place, so a present `<name>/` is always complete
and attaching needs no lock. Every rank maps the files read-only (`np.load(mmap_mode="r")`): the
pages live once in the node's tmpfs however many ranks map them, and a restarted rank (or a
spare taking over) re-attaches in milliseconds.
"""
from __future__ import annotations

import json
import os
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
from filelock import FileLock, Timeout

from .. import config as C
from ..errors import HpctError, describe
from ..hooks.shm import check_name, job_dir, remove_tree_at

INDEX = "index.json"
FORMAT_VERSION = 1
_BUILDING = ".building-"

Builder = Callable[[], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class ArraySpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class CacheIndex:
    name: str
    arrays: tuple[ArraySpec, ...]
    built_on: str
    build_s: float
    version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: Path, name: str) -> "CacheIndex":
        """The index of cache `name`, read from `where`. Everything in it is checked, array
        names above all: they become file paths, and `../../x` would load from outside."""
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            if d.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {d.get('version')!r}, not {FORMAT_VERSION}")
            if d["name"] != name:
                raise ValueError(f"it names cache {d['name']!r}")
            arrays = tuple(_array_spec(a) for a in d["arrays"])
            return cls(name, arrays, str(d["built_on"]), float(d["build_s"]), FORMAT_VERSION)
        except (ValueError, KeyError, TypeError, HpctError) as exc:
            raise HpctError(f"cache index {where} is unreadable ({describe(exc)}); remove "
                            f"{where.parent} to rebuild it") from None


def _array_spec(a: object) -> ArraySpec:
    if not isinstance(a, dict):
        raise ValueError(f"array entry {a!r} is not a JSON object")
    name = check_name(a["name"], what="array name")
    if not isinstance(a["dtype"], str) or len(a["dtype"]) > 32:
        raise ValueError(f"array {name!r} has dtype {a['dtype']!r}, not a numpy dtype string")
    dtype = np.dtype(a["dtype"])
    if dtype.hasobject:  # np.load refuses to unpickle them anyway
        raise ValueError(f"array {name!r} has dtype {a['dtype']!r}, which holds objects")
    shape, nbytes = a["shape"], a["nbytes"]
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
            and type(nbytes) is int and nbytes >= 0):
        raise ValueError(f"array {name!r} has shape {shape!r} and nbytes {nbytes!r}")
    return ArraySpec(name, dtype.str, tuple(shape), nbytes)


@dataclass
class CacheEntry:
    """One attached cache. `built` is True only in the process that built it."""

    name: str
    path: Path
    index: CacheIndex
    arrays: dict[str, np.ndarray]
    built: bool
    wait_s: float
    attach_s: float


def _files_bytes(dir_fd: int, name: str) -> int:
    """Total size of the regular files directly in `name` (relative to dir_fd), no links
    followed."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return 0
    try:
        total = 0
        for child in os.listdir(fd):
            try:
                st = os.stat(child, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
        return total
    finally:
        os.close(fd)


def budget_from_env(environ: Mapping[str, str]) -> int | None:
    return C.read(environ, C.CACHE_MB)


class SharedCache:
    """The caches of one job on one node, under `directory` (the job's shm dir)."""

    def __init__(self, directory: str | os.PathLike, budget_mb: int | None = None):
        self.directory = Path(directory)
        self.budget_mb = budget_mb
        if not self.directory.is_dir():
            raise HpctError(f"cache directory {self.directory} does not exist (the Prolog "
                            f"creates the job's shm dir: is it configured on this node?)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "SharedCache":
        """HPCT_SHM_DIR (exported into tasks) or the job's dir under the shm root; the budget
        is HPCT_CACHE_MB, the prolog's grant."""
        directory = C.read(environ, C.SHM_DIR) or job_dir(environ)
        return cls(directory, budget_from_env(environ))

    def get(self, name: str, build: Builder, timeout: float = 3600.0) -> CacheEntry:
        """Attach to cache `name`, building it first if no rank on this node has."""
        check_name(name)
        t0 = time.perf_counter()
        path = self.directory / name
        if (path / INDEX).exists():
            return self._attach(name, built=False, wait_s=0.0, t0=t0)
        try:
            with FileLock(str(self.directory / f".{name}.lock"), timeout=timeout):
                wait_s = time.perf_counter() - t0
                if (path / INDEX).exists():  # another rank built it while we waited
                    return self._attach(name, built=False, wait_s=wait_s, t0=t0)
                self._build(name, build)
        except Timeout:
            raise HpctError(f"cache {name!r}: no lock on {self.directory} within {timeout:g} s "
                            f"(another rank is still building it)") from None
        return self._attach(name, built=True, wait_s=wait_s, t0=t0)

    def remove(self, name: str) -> bool:
        check_name(name)
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            remove_tree_at(fd, name)
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)

    def existing_bytes(self) -> dict[str, int]:
        """Bytes of every complete cache in the directory, by name: what its index lists, or,
        for an index that cannot be read, the sizes of its files."""
        out = {}
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for entry in os.listdir(fd):
                if entry.startswith("."):  # lock files and half-built caches
                    continue
                try:
                    st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:  # removed while we looked
                    continue
                path = self.directory / entry
                if not stat.S_ISDIR(st.st_mode) or not (path / INDEX).is_file():
                    continue
                try:
                    out[entry] = CacheIndex.from_json((path / INDEX).read_text(),
                                                      path / INDEX, entry).nbytes
                except (HpctError, OSError):
                    out[entry] = _files_bytes(fd, entry)
        finally:
            os.close(fd)
        return out

    # ---- internals ---------------------------------------------------------------------
    def _build(self, name: str, build: Builder) -> None:
        t0 = time.perf_counter()
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for entry in os.listdir(fd):  # a builder that crashed left its half-made dir
                if entry.startswith(f".{name}{_BUILDING}"):
                    remove_tree_at(fd, entry)
        finally:
            os.close(fd)
        arrays = {k: np.ascontiguousarray(v) for k, v in build().items()}
        if not arrays:
            raise HpctError(f"cache {name!r}: the builder returned no arrays")
        for key in arrays:
            check_name(key, what=f"cache {name!r} array name")
        total = sum(a.nbytes for a in arrays.values())
        if self.budget_mb is not None:
            # The grant is the job's, not one cache's: every cache already in the job's dir
            # counts against it too.
            others = self.existing_bytes()
            if total + sum(others.values()) > self.budget_mb << 20:
                held = ", ".join(f"{k} {v / 2**20:.1f} MB" for k, v in sorted(others.items()))
                raise HpctError(
                    f"cache {name!r} needs {total / 2**20:.1f} MB"
                    + (f" on top of this job's other caches ({held})" if others else "")
                    + f" but this job's shm budget on {socket.gethostname()} is "
                    f"{self.budget_mb} MB (HPCT_CACHE_MB): ask for more with --hpct-cache-mb"
                    + (" or remove a cache" if others else ""))
        tmp = self.directory / f".{name}{_BUILDING}{os.getpid()}"
        tmp.mkdir(mode=0o700)
        specs = []
        for key, arr in arrays.items():
            out = np.lib.format.open_memmap(tmp / f"{key}.npy", mode="w+", dtype=arr.dtype,
                                            shape=arr.shape)
            out[...] = arr
            out.flush()
            del out
            specs.append(ArraySpec(key, arr.dtype.str, tuple(arr.shape), arr.nbytes))
        index = CacheIndex(name, tuple(specs), socket.gethostname(),
                           round(time.perf_counter() - t0, 6))
        (tmp / INDEX).write_text(index.to_json())
        os.rename(tmp, self.directory / name)

    def _attach(self, name: str, built: bool, wait_s: float, t0: float) -> CacheEntry:
        path = self.directory / name
        index = CacheIndex.from_json((path / INDEX).read_text(), path / INDEX, name)
        arrays = {}
        for spec in index.arrays:
            try:
                arr = np.load(path / f"{spec.name}.npy", mmap_mode="r")
            except (OSError, ValueError) as exc:
                raise HpctError(f"cache {name!r} array {spec.name!r} cannot be loaded "
                                f"({describe(exc)}); remove {path} to rebuild it") from None
            if arr.dtype.str != spec.dtype or arr.shape != spec.shape:
                raise HpctError(f"cache {name!r} array {spec.name!r} is {arr.dtype.str} "
                                f"{arr.shape}, its index says {spec.dtype} {spec.shape}; "
                                f"remove {path} to rebuild it")
            arrays[spec.name] = arr
        return CacheEntry(name, path, index, arrays, built, round(wait_s, 6),
                          round(time.perf_counter() - t0, 6))
