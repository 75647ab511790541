"""The zip container of ``torch.save`` files, written record by record (tensor data copied from other files).

torch's own writer (``PyTorchFileWriter``) needs every record's bytes in memory and computes their
CRC-32 itself. Consolidation and resharding mostly move bytes that already sit in another file: a
dim-0 shard is a contiguous byte range of the full tensor. ``ZipWriter.add_ranges`` copies such
ranges in threads with ``copy_ranges`` (``_file_ranges.py``), which also yields the record's CRC-32,
so the output costs about a file copy.

The layout is torch's (miniz's): stored records, data aligned to 64 bytes by an ``FB`` padding field,
a data descriptor after each record, zip64 fields past 4 GiB, and a zip64 end record. ``torch.load``
(with ``mmap=True`` and ``weights_only=True`` too), ``zipfile`` and ``verify_file`` read the result;
the round-trip tests guard the format.
"""

import os
import struct
import zipfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

from .file_ranges import FileRange, copy_ranges

__all__ = ["ZipWriter", "record_table"]

_ALIGNMENT = 64  # torch.serialization._get_storage_alignment()
_ZIP32_LIMIT = 0xFFFFFFFF  # sizes and offsets at or above this need zip64 fields (tests lower it)
_FLAGS = 0x0808  # bit 3: sizes and CRC in the data descriptor; bit 11: UTF-8 names (as miniz writes)
_CHUNK = 1 << 26  # bytes per write() of a record
NUM_COPY_THREADS = 2  # copies in flight at once; reads and writes release the GIL


def record_table(path: str) -> dict[int, tuple[str, int, int]]:
    """Every record of the zip file ``path``: data offset -> (name, size, CRC-32). Stored records only."""
    table = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset)
            header = f.read(30)
            if header[:4] != b"PK\x03\x04":
                raise zipfile.BadZipFile(f"member {info.filename!r} has no local header at byte {info.header_offset}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            table[info.header_offset + 30 + name_len + extra_len] = (info.filename, info.file_size, info.CRC)
    return table


class ZipWriter:
    """Write a stored zip archive, one record after another, to ``path`` (created or truncated).

    Records are named ``archive/<name>``, as ``torch.save`` names them. Call ``close`` to write the
    central directory; until then the file is not a valid archive. ``write_back`` and
    ``check_sources`` are passed to ``copy_ranges``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        num_copy_threads: int = NUM_COPY_THREADS,
        write_back: bool = True,
        check_sources: bool = False,
    ) -> None:
        self._write_back = write_back
        self._check_sources = check_sources
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pos = 0
        # name, header offset, size, and the CRC-32 or the copy that returns it
        self._entries: list[tuple[bytes, int, int, int | Future[int]]] = []
        self._num_copy_threads = num_copy_threads
        self._pool: ThreadPoolExecutor | None = None

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

    def _descriptor(self, header_offset: int, size: int, crc: int) -> bytes:
        if size >= _ZIP32_LIMIT or header_offset >= _ZIP32_LIMIT:
            return struct.pack("<IIQQ", 0x08074B50, crc, size, size)
        return struct.pack("<IIII", 0x08074B50, crc, size, size)

    def add_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Add a record holding ``data``."""
        view = memoryview(data).cast("B")
        header_offset = self._pos
        encoded = self._begin(name, view.nbytes)
        self._write(view)
        crc = zlib.crc32(view)
        self._write(self._descriptor(header_offset, view.nbytes, crc))
        self._entries.append((encoded, header_offset, view.nbytes, crc))

    def add_ranges(self, name: str, ranges: list[FileRange]) -> None:
        """Add a record holding the concatenated ``ranges``, copied from their files in a thread.

        The record's CRC-32 comes from the copy (see ``copy_ranges``); the copy writes the data
        descriptor after the data, and ``close`` the central directory once every copy is done.
        """
        size = sum(r.length for r in ranges)
        header_offset = self._pos
        encoded = self._begin(name, size)
        data_offset = self._pos
        # Every record's place is fixed once its header is written, so the copies can run in
        # threads while the next headers are written.
        self._pos += size + len(self._descriptor(header_offset, size, 0))
        os.lseek(self._fd, self._pos, os.SEEK_SET)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_copy_threads, thread_name_prefix="torchacc-copy")
        copy = self._pool.submit(self._copy_record, ranges, header_offset, data_offset, size)
        self._entries.append((encoded, header_offset, size, copy))

    def _copy_record(self, ranges: list[FileRange], header_offset: int, data_offset: int, size: int) -> int:
        crc = copy_ranges(ranges, self._fd, data_offset, write_back=self._write_back, check_sources=self._check_sources)
        os.pwrite(self._fd, self._descriptor(header_offset, size, crc), data_offset + size)
        return crc

    def _finish_copies(self, cancel: bool) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=cancel)
            self._pool = None
        if not cancel:  # result() re-raises a failed copy (a truncated or corrupt source file)
            self._entries = [(n, o, s, c.result() if isinstance(c, Future) else c) for n, o, s, c in self._entries]

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
