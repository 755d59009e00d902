"""Reading a request's token ids where they arrived: `tokens.u32le` as a view into the bytes gRPC
delivered, every other field parsed by the protobuf library.

A Lookup, Load, Resume or LoadLocal of a long prompt carries 4 bytes a token (3.6 MB for 900K
tokens). The library's parser copies that field into its own memory, and reading it copies it out
again: two copies, each one C call that holds the interpreter lock for as long as it takes to fault
in fresh pages, while every other tenant's call waits for the lock (`kvstore bench abuse --only
huge_lookups`). Here the request's bytes are walked by hand: the u32le field becomes a memoryview,
and the rest of the message (small: names, the ids field if that form was used) is joined and
given to the library, which validates it as it always does. The store's key walk, which reads
ids as `bytes`, copies them only as far as it reads (the first 256 chunks, the rest only when all
of those are held): a prompt never seen costs a few hundred KiB of copies, not two of its size.

The wire format is followed as the library reads it: fields in any order, unknown fields skipped,
a `tokens` sub-message repeated in place merging (its last u32le wins, its ids add up). A message
that does not parse raises DecodeError, as the library would. tests/test_tokens_in_place.py checks
it against the library on generated and mutated messages. A request of more than FIELDS_BY_HAND
fields (unpacked ids, unknown fields: legal, but no client sends them) is parsed whole by the
library instead, its token bytes copied out: walked here, each field would cost ~100 times what the
library takes, all under the interpreter lock.

What it does not know: what the tokens mean, or the limits on their number (`messages.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError, Message

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.wire_format import (
    FIELDS_BY_HAND,
    LEN,
    MAX_DEPTH,
    FieldBudget,
    NotByHand,
    encode_varint,
    fields,
)

M = TypeVar("M", bound=Message)

U32LE_FIELD = 1
assert pb.Tokens.DESCRIPTOR.fields_by_name["u32le"].number == U32LE_FIELD


@dataclass(frozen=True)
class WithTokens(Generic[M]):
    """A request whose `tokens.u32le` is read in place: `message` holds every other field (its
    `tokens.u32le` empty), `u32le` the token bytes (empty when the request did not set them)."""

    message: M
    u32le: memoryview


def tokens_field(cls: type[Message]) -> int | None:
    """The number of `cls`'s top-level `tokens` field of type Tokens, None where it has none."""
    f = cls.DESCRIPTOR.fields_by_name.get("tokens")
    return f.number if f is not None and f.message_type is pb.Tokens.DESCRIPTOR else None


def tokens_in_place(cls: type[M]) -> Callable[[bytes], WithTokens[M]]:
    """A request deserializer for `cls`, which has a top-level `tokens` field."""
    number = tokens_field(cls)
    if number is None:
        raise ValueError(f"{cls.DESCRIPTOR.full_name} has no top-level tokens field")
    tag = encode_varint(number << 3 | LEN)
    name = cls.DESCRIPTOR.full_name

    def decode(data: bytes) -> WithTokens[M]:
        view = memoryview(data)
        u32le = view[0:0]
        rest = bytearray()  # the message without tokens.u32le, for the library
        budget = FieldBudget(FIELDS_BY_HAND)
        try:
            for field, wire, a, b, at in fields(data, 0, len(data), budget):
                if field != number or wire != LEN:
                    rest += view[at:b]
                    continue
                others = bytearray()  # the Tokens fields besides u32le (the ids form, unknowns)
                for inner, inner_wire, c, d, inner_at in fields(data, a, b, budget, MAX_DEPTH - 1):
                    if inner == U32LE_FIELD and inner_wire == LEN:
                        u32le = view[c:d]
                    else:
                        others += view[inner_at:d]
                rest += tag + encode_varint(len(others)) + others
        except IndexError:
            raise DecodeError(f"truncated {name} message") from None
        except NotByHand:
            whole = cls.FromString(data)
            u32le = view[0:0]
            if whole.HasField("tokens"):
                tokens = whole.tokens  # type: ignore[attr-defined]
                u32le = memoryview(tokens.u32le)
                tokens.ClearField("u32le")
            return WithTokens(whole, u32le)
        return WithTokens(cls.FromString(bytes(rest)), u32le)

    return decode
