"""How the client reads the messages of a Load or Resume stream without copying their payloads:
the `chunks` field of `LoadResponse` / `ResumeResponse` is read off the wire bytes by
`wire/pieces.py`, its payload a memoryview into the message gRPC delivered (for a 29 MB load, two
copies of every byte fewer than the protobuf library makes); every other field is parsed by the
library. tests/test_client_wire.py checks it against the library on generated messages.

What it does not know: what the chunks hold, or how a stream is reassembled (replies.py).
"""

from __future__ import annotations

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.pieces import PieceView, Streamed, stream_decoder

__all__ = ["PieceView", "Streamed", "decode_load_response", "decode_resume_response"]

decode_load_response = stream_decoder(pb.LoadResponse, {1: ("header", pb.LoadHeader), 3: ("shm", pb.ShmSpan)})
decode_resume_response = stream_decoder(
    pb.ResumeResponse, {1: ("header", pb.ResumeHeader), 3: ("local", pb.LocalPiece), 4: ("trailer", pb.ResumeTrailer),
                        5: ("shm", pb.ShmSpan), 6: ("local_shm", pb.ShmSpan)})
