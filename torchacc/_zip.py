"""The zip container of ``torch.save`` files, written record by record, and byte ranges copied between files.

torch's own writer (``PyTorchFileWriter``) needs every record's bytes in memory and computes their
CRC-32 itself. Consolidation and resharding mostly move bytes that already sit in another file: a
dim-0 shard is a contiguous byte range of the full tensor. ``ZipWriter.add_ranges`` copies such
ranges inside the kernel (``copy_file_range``, no pass through user space) and derives the record's
CRC-32 from the source records' CRCs (``crc32_combine``), so the output costs about a file copy.

The layout is torch's (miniz's): stored records, data aligned to 64 bytes by an ``FB`` padding field,
a data descriptor after each record, zip64 fields past 4 GiB, and a zip64 end record. ``torch.load``
(with ``mmap=True`` and ``weights_only=True`` too), ``zipfile`` and ``verify_file`` read the result;
the round-trip tests guard the format.
"""

import errno
import os
import struct
import zipfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["FileRange", "ZipWriter", "copy_ranges", "crc32_combine", "file_crc32", "read_ranges", "record_table"]

_ALIGNMENT = 64  # torch.serialization._get_storage_alignment()
_ZIP32_LIMIT = 0xFFFFFFFF  # sizes and offsets at or above this need zip64 fields (tests lower it)
_FLAGS = 0x0808  # bit 3: sizes and CRC in the data descriptor; bit 11: UTF-8 names (as miniz writes)
_CHUNK = 1 << 26  # bytes per copy_file_range call, and per write-back request
_POLY = 0xEDB88320
NUM_COPY_THREADS = 2  # copies in flight at once: enough to keep a 2-core machine's kernel copying
_NO_COPY_FILE_RANGE = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


@dataclass(frozen=True)
class FileRange:
    """``length`` bytes at ``offset`` in ``path``; ``crc`` is their CRC-32 when a zip record says so."""

    path: str
    offset: int
    length: int
    crc: int | None = None


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


def record_table(path: str) -> dict[int, tuple[str, int, int]]:
    """Every record of the zip file ``path``: data offset -> (name, size, CRC-32). Stored records only."""
    table = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            table[info.header_offset + 30 + name_len + extra_len] = (info.filename, info.file_size, info.CRC)
    return table


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


class ZipWriter:
    """Write a stored zip archive, one record after another, to ``path`` (created or truncated).

    Records are named ``archive/<name>``, as ``torch.save`` names them. Call ``close`` to write the
    central directory; until then the file is not a valid archive.
    """

    def __init__(self, path: str | os.PathLike[str], *, num_copy_threads: int = NUM_COPY_THREADS) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pos = 0
        self._entries: list[tuple[bytes, int, int, int]] = []  # name, header offset, size, crc
        self._num_copy_threads = num_copy_threads
        self._pool: ThreadPoolExecutor | None = None
        self._copies: list[Future] = []

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:  # a huge single write() is slow on some file systems, and may be short
            written = os.write(self._fd, view[:_CHUNK])
            view = view[written:]
            self._pos += written

    def _begin(self, name: str, size: int) -> bytes:
        encoded = f"archive/{name}".encode()
        offset = self._pos
        zip64 = b""
        if size >= _ZIP32_LIMIT or offset >= _ZIP32_LIMIT:  # miniz's local zip64 field, for its offset maths
            values = ((size, size) if size >= _ZIP32_LIMIT else ()) + ((offset,) if offset >= _ZIP32_LIMIT else ())
            zip64 = struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values)
        start = offset + 30 + len(encoded) + len(zip64) + 4
        padding = -start % _ALIGNMENT
        extra = zip64 + struct.pack("<2sH", b"FB", padding) + b"Z" * padding
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(encoded), len(extra)))
        self._write(encoded + extra)
        return encoded

    def _end(self, encoded: bytes, header_offset: int, size: int, crc: int) -> None:
        if size >= _ZIP32_LIMIT or header_offset >= _ZIP32_LIMIT:
            self._write(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
        else:
            self._write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        self._entries.append((encoded, header_offset, size, crc))

    def add_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Add a record holding ``data``."""
        view = memoryview(data).cast("B")
        header_offset = self._pos
        encoded = self._begin(name, view.nbytes)
        self._write(view)
        self._end(encoded, header_offset, view.nbytes, zlib.crc32(view))

    def add_ranges(self, name: str, ranges: list[FileRange]) -> None:
        """Add a record holding the concatenated ``ranges``, copied file to file without passing through memory.

        A range's CRC-32 is taken from ``FileRange.crc`` when given (callers verify the source
        files), or else computed by reading the range.
        """
        size = sum(r.length for r in ranges)
        header_offset = self._pos
        encoded = self._begin(name, size)
        crc = 0
        for r in ranges:
            crc = crc32_combine(crc, r.crc if r.crc is not None else file_crc32(r.path, r.offset, r.length), r.length)
        # Every record's place is fixed once its header is written, so the copies can run in
        # threads (copy_file_range releases the GIL) while the next headers are written.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_copy_threads, thread_name_prefix="torchacc-copy")
        self._copies.append(self._pool.submit(copy_ranges, ranges, self._fd, self._pos))
        self._pos += size
        os.lseek(self._fd, self._pos, os.SEEK_SET)
        self._end(encoded, header_offset, size, crc)

    def _finish_copies(self, cancel: bool) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=cancel)
            self._pool = None
        copies, self._copies = self._copies, []
        if not cancel:
            for copy in copies:
                copy.result()  # re-raises a failed copy (a truncated source file)

    def close(self) -> None:
        """Wait for the copies, write the central directory and the end records, and close the file."""
        self._finish_copies(cancel=False)
        cd_offset = self._pos
        for encoded, offset, size, crc in self._entries:
            big = [v for v in (size, size) if v >= _ZIP32_LIMIT] + ([offset] if offset >= _ZIP32_LIMIT else [])
            extra = struct.pack(f"<HH{len(big)}Q", 1, 8 * len(big), *big) if big else b""
            small_size, small_offset = _small(size), _small(offset)
            fields = (0x02014B50, 45, 45, _FLAGS, 0, 0, 0, crc, small_size, small_size, len(encoded), len(extra))
            self._write(struct.pack("<IHHHHHHIIIHHHHHII", *fields, 0, 0, 0, 0, small_offset) + encoded + extra)
        count, cd_size, end64_offset = len(self._entries), self._pos - cd_offset, self._pos
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, end64_offset, 1))
        small_count = min(count, 0xFFFF)
        small_cd = (_small(cd_size), _small(cd_offset))
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, small_count, small_count, *small_cd, 0))
        os.close(self._fd)
        self._fd = -1

    def abort(self) -> None:
        """Close the file without finishing it (the caller removes it)."""
        self._finish_copies(cancel=True)  # no thread may write to the descriptor after it is closed
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _small(value: int) -> int:
    """A 32-bit zip field: the value, or the marker that says "see the zip64 field"."""
    return value if value < _ZIP32_LIMIT else 0xFFFFFFFF


def copy_ranges(ranges: list[FileRange], dst_fd: int, dst_offset: int) -> None:
    """Copy the concatenated ``ranges`` to ``dst_fd`` at ``dst_offset``, inside the kernel where it can.

    The file position of ``dst_fd`` is left alone. Write-back of the copied bytes starts right away,
    so a final ``fsync`` finds little left to do.
    """
    for r in ranges:
        _copy_range(r, dst_fd, dst_offset)
        dst_offset += r.length


def _copy_range(r: FileRange, dst_fd: int, dst_offset: int) -> None:
    src_fd = os.open(r.path, os.O_RDONLY)
    try:
        done = 0
        while done < r.length:
            count = min(r.length - done, _CHUNK)
            try:
                n = os.copy_file_range(src_fd, dst_fd, count, r.offset + done, dst_offset + done)
            except (AttributeError, OSError) as exc:  # not Linux, or a file system pair without it
                if isinstance(exc, OSError) and exc.errno not in _NO_COPY_FILE_RANGE:
                    raise
                n = os.pwrite(dst_fd, os.pread(src_fd, count, r.offset + done), dst_offset + done)
            if n == 0:
                raise ValueError(f"{r.path}: ends before byte {r.offset + r.length}; the file is truncated")
            if hasattr(os, "posix_fadvise"):  # on Linux DONTNEED starts the write-back of dirty pages
                os.posix_fadvise(dst_fd, dst_offset + done, n, os.POSIX_FADV_DONTNEED)
            done += n
    finally:
        os.close(src_fd)


def file_crc32(path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> int:
    """CRC-32 of ``length`` bytes of ``path`` from ``offset`` (default: to the end), read in chunks.

    Raises:
        ValueError: the file ends before ``offset + length``.
    """
    crc, done = 0, 0
    with open(path, "rb", buffering=0) as f:
        while length is None or done < length:
            size = 1 << 23 if length is None else min(length - done, 1 << 23)
            data = os.pread(f.fileno(), size, offset + done)
            if not data:
                if length is None:
                    break
                raise ValueError(f"{os.fspath(path)}: ends before byte {offset + length}; the file is truncated")
            crc = zlib.crc32(data, crc)
            done += len(data)
    return crc
