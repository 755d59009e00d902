"""The same-host data plane: chunk bytes through shared memory, beside gRPC's control plane.

When an engine and the service share a host, the service listens on a Unix socket as well as TCP.
A client that reaches it over the Unix socket opens a second, plain Unix socket beside it (the
gRPC socket's path plus `.shm`), authenticates there, and receives two memory segments as file
descriptors: a load segment the service writes and the client can only read, and a store segment
the client writes and the service reads. `Load` and `Resume` then answer with spans of the load
segment under a lease instead of bytes, and `Store` commits spans of the store segment.

This package holds what both sides share, and knows neither the service nor gRPC: segments (`segments.py`), the
framed messages and descriptor passing of the side socket (`side_socket.py`), the allocation of a
segment's space under leases (`leases.py`), the checks of a span against its segment (`spans.py`),
and the connecting end of a session (`peer.py`), which the client and attached replay runners both
use. On a GPU: memory of the device tier shared by CUDA IPC handles (`cuda_ipc.py`), and copies of
chunk rows between host memory, pinned host memory and a GPU (`rows.py`, which the tiers use
too); both import torch, and the client imports them only when a session offers GPU memory. The
service's listener lives in `kvstore.service.shm_listener`.
"""

from kvstore.dataplane.leases import Lease, LeaseTable, NoRoom, TableClosed
from kvstore.dataplane.peer import LeaseLapsed, SessionClosed, ShmPath, ShmUnavailable
from kvstore.dataplane.segments import (
    Segment,
    SegmentWatch,
    map_segment,
    sealing_available,
    watch_queue_events,
    watching_available,
)
from kvstore.dataplane.side_socket import (
    HELLO_VERSION,
    ID_RE,
    TOO_LARGE_FOR_SESSION,
    UNKNOWN_SESSION,
    FrameReader,
    SideSocketClosed,
    data_socket_path,
    new_id,
    recv_message,
    send_message,
    unix_path_of,
)
from kvstore.dataplane.spans import check_span

__all__ = [
    "HELLO_VERSION",
    "ID_RE",
    "TOO_LARGE_FOR_SESSION",
    "UNKNOWN_SESSION",
    "FrameReader",
    "Lease",
    "LeaseLapsed",
    "LeaseTable",
    "NoRoom",
    "Segment",
    "SegmentWatch",
    "SessionClosed",
    "ShmPath",
    "ShmUnavailable",
    "SideSocketClosed",
    "TableClosed",
    "check_span",
    "data_socket_path",
    "map_segment",
    "new_id",
    "recv_message",
    "sealing_available",
    "send_message",
    "unix_path_of",
    "watch_queue_events",
    "watching_available",
]
