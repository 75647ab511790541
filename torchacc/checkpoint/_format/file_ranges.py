"""Byte ranges of files: copied into another file, read into memory, and their CRC-32s combined.

Consolidation and resharding move bytes that already sit in the shard files (a dim-0 shard is a
contiguous byte range of the full tensor). ``copy_ranges`` moves them through a small buffer that each
thread reuses, computing their CRC-32 as they pass and, when asked, checking whole zip records
against the CRC-32 they carry; ``crc32_combine`` derives the CRC-32 of a concatenation without the bytes.
"""

import os
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["FileRange", "copy_ranges", "corrupt_member_message", "crc32_combine", "file_crc32", "read_ranges"]

_WRITE_BACK = 1 << 26  # bytes copied per write-back request
# Copying through a buffer that stays in the CPU cache beat copy_file_range and sendfile between
# unaligned offsets (0.46 s against 0.85 s for 2.15 GB; benchmarks/README.md, "Consolidation").
_COPY_BUFFER = 1 << 20
_POLY = 0xEDB88320
_buffers = threading.local()


@dataclass(frozen=True)
class FileRange:
    """``length`` bytes at ``offset`` in ``path``; when they are a whole zip record, ``crc`` is its CRC-32
    and ``member`` its name."""

    path: str
    offset: int
    length: int
    crc: int | None = None
    member: str | None = None


def corrupt_member_message(path: str | os.PathLike[str], member: str) -> str:
    """The error for a zip member whose bytes do not match its CRC-32."""
    return f"{os.fspath(path)}: member {member!r} fails its CRC-32 check; the file is corrupt, restore it or re-save"


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (bit-reflected), as in zlib's crc32.c."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's ``crc32_combine``)."""
    p, k, n = 1 << 31, 3, len2  # x^(8 * len2): the shift of A's CRC past B's bytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def read_ranges(ranges: list[FileRange], out: memoryview) -> None:
    """Read the concatenated ``ranges`` into ``out`` (exactly their total length)."""
    out = memoryview(out).cast("B")
    position = 0
    for r in ranges:
        with open(r.path, "rb", buffering=0) as f:
            f.seek(r.offset)
            done = 0
            while done < r.length:
                n = f.readinto(out[position + done : position + r.length])
                if not n:
                    raise ValueError(f"{r.path}: ends before byte {r.offset + r.length}; the file is truncated")
                done += n
        position += r.length
    if position != out.nbytes:
        raise AssertionError(f"ranges hold {position} bytes, the buffer {out.nbytes}")


def copy_ranges(
    ranges: list[FileRange], dst_fd: int, dst_offset: int, *, write_back: bool = True, check_sources: bool = False
) -> int:
    """Copy the concatenated ``ranges`` to ``dst_fd`` at ``dst_offset``; return their CRC-32.

    A range's CRC-32 is computed from the bytes as they pass, or, for a range with a known ``crc``,
    taken from it. ``check_sources`` computes those too and compares: the copy then verifies every
    whole source record it reads, for the cost of the CRC alone. The file position of ``dst_fd``
    is left alone. With ``write_back``, write-back of the copied bytes starts right away, so a final
    ``fsync`` finds little left to do; without it the bytes stay in the page cache until the kernel
    writes them back, as after ``shutil.copyfile``.

    Raises:
        ValueError: a source file ends before its range does, or a range fails its known CRC-32.
    """
    view, crc = _buffer(), 0
    for r in ranges:
        compute = r.crc is None or check_sources
        got = _copy_range(r, dst_fd, dst_offset, view, write_back=write_back, compute_crc=compute)
        if r.crc is not None and compute and got != r.crc:
            raise ValueError(corrupt_member_message(r.path, r.member or f"at byte {r.offset}"))
        crc = crc32_combine(crc, r.crc if r.crc is not None else got, r.length)
        dst_offset += r.length
    return crc


def _buffer() -> memoryview:
    """This thread's copy buffer: reused, so copies allocate (and page-fault) nothing per chunk."""
    view = getattr(_buffers, "view", None)
    if view is None:
        view = _buffers.view = memoryview(bytearray(_COPY_BUFFER))
    return view


def _copy_range(
    r: FileRange, dst_fd: int, dst_offset: int, view: memoryview, *, write_back: bool, compute_crc: bool
) -> int:
    done = flushed = crc = 0
    for chunk in _read_chunks(r.path, r.offset, r.length, view):
        if compute_crc:
            crc = zlib.crc32(chunk, crc)
        written = 0
        while written < len(chunk):
            written += os.pwrite(dst_fd, chunk[written:], dst_offset + done + written)
        done += len(chunk)
        if write_back and (done - flushed >= _WRITE_BACK or done == r.length) and hasattr(os, "posix_fadvise"):
            # on Linux DONTNEED starts the write-back of dirty pages
            os.posix_fadvise(dst_fd, dst_offset + flushed, done - flushed, os.POSIX_FADV_DONTNEED)
            flushed = done
    return crc


def _read_chunks(
    path: str | os.PathLike[str], offset: int, length: int | None, view: memoryview
) -> Iterator[memoryview]:
    """``length`` bytes of ``path`` from ``offset`` (None: to the end), read into ``view`` one chunk at a time.

    Raises:
        ValueError: the file ends before ``offset + length``.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while length is None or done < length:
            n = os.preadv(fd, [view if length is None else view[: min(length - done, len(view))]], offset + done)
            if n == 0:
                if length is None:
                    return
                raise ValueError(f"{os.fspath(path)}: ends before byte {offset + length}; the file is truncated")
            yield view[:n]
            done += n
    finally:
        os.close(fd)


def file_crc32(path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> int:
    """CRC-32 of ``length`` bytes of ``path`` from ``offset`` (default: to the end), read in chunks.

    Raises:
        ValueError: the file ends before ``offset + length``.
    """
    crc = 0
    for chunk in _read_chunks(path, offset, length, _buffer()):
        crc = zlib.crc32(chunk, crc)
    return crc
