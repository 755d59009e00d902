"""LMDB's data file read as a file, not through the map: a file cut short is refused at open.

LMDB maps the file, and reading a page past its end kills the process with SIGBUS, without a word;
`check_length` reads the newest meta page's last page number and, where the file ends before it,
the free list (with pread: a page missing from the file is an error here, not a SIGBUS). It knows
LMDB's file format (mdb.c, 64-bit builds), enough for that; it knows nothing of the tier, its
databases or its values.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import lmdb

from kvstore.errors import StorageError

# A page header is pgno (8), pad (2), flags (2), lower (2), upper (2), then the node offsets; a node
# is lo (2), hi (2), flags (2), key size (2), key, data. A meta page holds, after the page header,
# magic (4), version (4), address (8), map size (8), the free list's MDB_db (48; its root at 40),
# the main one's, the last page number (8) and the transaction id (8).
PAGE_HEADER = 16
NODE_HEADER = 8
_META_MAGIC = 0xBEEFC0DE
_META_FREE_ROOT_AT, _META_TXNID_AT = 16 + 24 + 40, 16 + 24 + 2 * 48 + 8
_P_BRANCH, _F_BIGDATA, _NO_PAGE = 0x01, 0x01, (1 << 64) - 1


def check_length(env: lmdb.Environment, data: Path) -> None:
    """Refuse a data file cut short (a copy or a restore that stopped early): LMDB maps the file,
    and reading a page past its end kills the process with SIGBUS, without a word. LMDB may leave
    the file short of its last page number itself, by pages freed in the transaction that took
    them and so never written: those are on its free list, never read, and not refused."""
    psize = int(env.stat()["psize"])
    info = env.info()  # from the newest meta page: the one LMDB reads the trees from
    last = int(info["last_pgno"])
    size = data.stat().st_size
    if size >= (last + 1) * psize:
        return
    first = size // psize  # the first page not wholly in the file
    try:
        free = _free_pages(data, psize, int(info["last_txnid"]), first, last)
    except (OSError, ValueError, OverflowError, MemoryError, struct.error):  # the free list is cut, or unreadable
        free = set()
    if len(free) < last + 1 - first:
        raise StorageError(
            f"the LMDB data file {data} is {size} bytes but its last committed page ends at byte "
            f"{(last + 1) * psize}: the file was cut short; restore it or move it away")


def _free_pages(data: Path, psize: int, txnid: int, first: int, last: int) -> set[int]:
    """The pages in [first, last] that the free list of transaction `txnid`'s meta page holds, read
    with pread (a page missing from the file is an error here, not a SIGBUS). Each list is a count
    and that many page numbers (an MDB_IDL), inline or on overflow pages. A damaged or crafted file
    is bounded: no page is read twice (a tree that loops), and none past the last one."""
    fd = os.open(data, os.O_RDONLY)
    try:
        def page(pgno: int, n: int = 1) -> bytes:
            if pgno < 0 or n < 1 or pgno + n > last + 1:
                raise ValueError(f"pages {pgno}+{n} are past the last page {last}")
            got = os.pread(fd, n * psize, pgno * psize)
            if len(got) != n * psize:
                raise ValueError(f"page {pgno} is past the end of the file")
            return got

        roots = [struct.unpack_from("<Q", meta, _META_FREE_ROOT_AT)[0] for meta in (page(0), page(1))
                 if struct.unpack_from("<I", meta, 16)[0] == _META_MAGIC
                 and struct.unpack_from("<Q", meta, _META_TXNID_AT)[0] == txnid]
        if not roots:
            raise ValueError(f"no meta page of transaction {txnid}")
        free: set[int] = set()
        seen: set[int] = set()
        stack = [] if roots[0] == _NO_PAGE else [roots[0]]
        while stack:
            pgno = stack.pop()
            if pgno in seen:
                raise ValueError(f"page {pgno} is reached twice: the free list's tree is damaged")
            seen.add(pgno)
            p = page(pgno)
            flags, lower = struct.unpack_from("<HH", p, 10)
            for at in struct.unpack_from(f"<{(lower - PAGE_HEADER) >> 1}H", p, PAGE_HEADER):
                lo, hi, nflags, ksize = struct.unpack_from("<HHHH", p, at)
                if flags & _P_BRANCH:  # a child's page number, in lo, hi and flags
                    stack.append(lo | hi << 16 | nflags << 32)
                    continue
                start, size = at + NODE_HEADER + ksize, lo | hi << 16
                if nflags & _F_BIGDATA:
                    ov = struct.unpack_from("<Q", p, start)[0]
                    pages = struct.unpack_from("<I", page(ov), 12)[0]
                    ids = page(ov, pages)[PAGE_HEADER : PAGE_HEADER + size]
                else:
                    ids = p[start : start + size]
                n = struct.unpack_from("<Q", ids)[0]
                if n > (len(ids) - 8) // 8:
                    raise ValueError(f"a free list of {n} pages in {len(ids)} bytes")
                free.update(i for i in struct.unpack_from(f"<{n}Q", ids, 8) if first <= i <= last)
        return free
    finally:
        os.close(fd)
