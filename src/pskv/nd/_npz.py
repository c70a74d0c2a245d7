"""``.npz`` archives read as untrusted input: checkpoints' shards, optimizer-state files.

pskv writes these with ``np.savez`` (members stored, not compressed, no pickles). Reading
one back trusts nothing in it: the file must be a regular file (a FIFO or a device would
block or never end), opened without blocking; every member must be stored uncompressed with
its declared size inside the file (so no member can inflate: a deflate bomb is refused
unread); each array's ``.npy`` header must be a plain numeric dtype whose shape accounts for
exactly the member's bytes, checked before its data is read. Reads are therefore bounded by
the file's size. Anything wrong raises :class:`BadArchive`, which callers turn into their
own error (CheckpointError, OptimizerStateError).
"""
from __future__ import annotations

import io
import math
import os
import stat
import zipfile
from typing import IO, Any

import numpy as np
from numpy.lib import format as npy_format

__all__ = ["BadArchive", "SafeNpz", "open_regular", "read_bounded"]

#: members one archive may hold (a shard holds one per key part, plus two)
MAX_MEMBERS = 1 << 22
_MAX_NDIM = 32


class BadArchive(Exception):
    """A file is not an archive pskv wrote, or not one it may read; says why."""


def open_regular(path: str) -> IO[bytes]:
    """``path`` opened for reading, if it is a regular file (symlinks followed); never
    blocks on a FIFO. BadArchive otherwise (OSError if it cannot be opened)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadArchive(f"{path!r} is not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str, limit: int) -> bytes:
    """The bytes of the regular file ``path``; BadArchive if it holds more than ``limit``."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BadArchive(f"{path!r} is larger than the {limit} bytes such a file may hold")
    return data


def _header(member: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    version = npy_format.read_magic(member)
    if version == (1, 0):
        shape, fortran, dtype = npy_format.read_array_header_1_0(member, max_header_size=10000)
    elif version == (2, 0):
        shape, fortran, dtype = npy_format.read_array_header_2_0(member, max_header_size=10000)
    else:
        raise BadArchive(f".npy version {version} is not one pskv writes")
    return tuple(shape), bool(fortran), dtype


class SafeNpz:
    """The members of an ``.npz`` archive, checked; arrays read only once checked.

    Parameters
    ----------
    source : str or bytes
        A path (opened with :func:`open_regular`) or the archive's bytes.
    what : str
        How errors name the archive.
    """

    def __init__(self, source: str | bytes, what: str) -> None:
        self.what = what
        self._file: IO[bytes] = io.BytesIO(source) if isinstance(source, bytes) \
            else open_regular(source)
        try:
            size = os.fstat(self._file.fileno()).st_size if not isinstance(source, bytes) \
                else len(source)
            try:
                self._zip = zipfile.ZipFile(self._file)
            except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
                raise BadArchive(f"{what} is not a NumPy .npz archive ({err})") from err
            infos = self._zip.infolist()
            if len(infos) > MAX_MEMBERS:
                raise BadArchive(f"{what} holds {len(infos)} members, over {MAX_MEMBERS}")
            self._infos: dict[str, zipfile.ZipInfo] = {}
            total = 0
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED or \
                        info.compress_size != info.file_size:
                    raise BadArchive(f"member {info.filename!r} of {what} is compressed; pskv "
                                     "stores its archives' members uncompressed (np.savez)")
                if not info.filename.endswith(".npy") or info.filename in self._infos:
                    raise BadArchive(f"member {info.filename!r} of {what} is not one .npy array")
                total += info.file_size
                self._infos[info.filename[:-4]] = info
            if total > size:
                raise BadArchive(f"the members of {what} declare {total} bytes, more than its "
                                 f"{size} bytes")
        except BaseException:
            self.close()
            raise

    @property
    def files(self) -> list[str]:
        """The array names."""
        return list(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def shape_of(self, name: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
        """The shape and dtype array ``name`` declares, without reading it."""
        with self._zip.open(self._info(name)) as member:
            shape, _fortran, dtype = self._checked(name, member)
        return shape, dtype

    def _info(self, name: str) -> zipfile.ZipInfo:
        info = self._infos.get(name)
        if info is None:
            raise BadArchive(f"{self.what} has no array {name!r}")
        return info

    def _checked(self, name: str, member: Any) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
        try:
            shape, fortran, dtype = _header(member)
        except (ValueError, OSError, EOFError, SyntaxError) as err:
            raise BadArchive(f"array {name!r} of {self.what} has no readable header "
                             f"({err})") from err
        if dtype.hasobject or dtype.kind not in "biufc" or dtype.fields is not None \
                or len(shape) > _MAX_NDIM:
            raise BadArchive(f"array {name!r} of {self.what} is of dtype {dtype}, not numbers")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes != self._infos[name].file_size - member.tell():
            raise BadArchive(f"array {name!r} of {self.what} declares shape {shape} "
                             f"{dtype.name} ({nbytes} bytes), which its member does not hold")
        return shape, fortran, dtype

    def __getitem__(self, name: str) -> np.ndarray:
        """Array ``name`` (a new, writable array), read only after its header checked."""
        try:
            with self._zip.open(self._info(name)) as opened:
                member: Any = opened
                shape, fortran, dtype = self._checked(name, member)
                buf = bytearray(math.prod(shape) * dtype.itemsize)
                if member.readinto(buf) != len(buf):
                    raise BadArchive(f"array {name!r} of {self.what} is cut short")
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
            raise BadArchive(f"cannot read array {name!r} of {self.what} ({err})") from err
        arr: np.ndarray = np.frombuffer(buf, dtype=dtype)
        return arr.reshape(shape, order="F" if fortran else "C")

    def close(self) -> None:
        """Close the archive and its file."""
        z = getattr(self, "_zip", None)
        if z is not None:
            z.close()
        self._file.close()

    def __enter__(self) -> SafeNpz:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
