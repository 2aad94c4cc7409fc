"""The payload lane's wire format, declared once: every header with its fields, the
protocol's version, the reply kinds and the limits a peer may rely on.

``docs/lane.md`` is the specification (connection, hello, auth, errors, TLS);
:mod:`hio.transport.lane` speaks it. Every integer is unsigned and big-endian.
The messages carried (``LaneHello``, ``LaneStatus``, ``TupleFrame``,
``TupleReceipt``) are protobuf, declared in ``proto/hio/proto``.
"""

from __future__ import annotations

import collections
import struct
from typing import Any

VERSION = 2  # the lane version this code's clients propose: calls one after another on a connection
VERSIONS = (1, VERSION)  # every version a server here accepts in a hello (1: one call, then it closes)
MAGIC_PREFIX = b"HIOLANE"  # a hello's first 7 bytes; the 8th is the version as an ASCII digit


def magic(version: int = VERSION) -> bytes:
    """The 8 bytes that open a connection proposing ``version`` (1-9)."""
    return MAGIC_PREFIX + str(version).encode("ascii")


MAGIC = magic()  # b"HIOLANE2"


class Header:
    """A fixed-size header: named fields packed with one ``struct`` format (big-endian)."""

    def __init__(self, name: str, *fields: tuple[str, str]) -> None:
        self.name = name
        self.fields = tuple(field for field, _ in fields)
        self._struct = struct.Struct(">" + "".join(code for _, code in fields))
        self._tuple = collections.namedtuple(name, self.fields)  # type: ignore[misc]  # noqa: PYI024 - fields known only at run time
        self.size = self._struct.size

    def pack(self, *values: Any) -> bytes:
        return self._struct.pack(*values)

    def unpack(self, data: bytes) -> Any:
        """The fields of exactly :attr:`size` bytes, as a named tuple."""
        return self._tuple._make(self._struct.unpack(data))  # type: ignore[attr-defined]  # a namedtuple class

    def __repr__(self) -> str:
        return f"Header({self.name}: {', '.join(self.fields)}; {self.size} bytes)"


# client -> server, opening each call: MAGIC, then the LaneHello's size, then the LaneHello
HELLO = Header("Hello", ("magic", "8s"), ("size", "I"))
# a frame, either way (uploads: client -> server; downloads: server -> client)
FRAME_PREFIX = Header("Frame", ("head_size", "I"), ("data_size", "Q"))  # then head, then data
END_OF_INPUT = FRAME_PREFIX.pack(0, 0)  # no frame is empty: this prefix ends the frames
# server -> client: receipts and the final status
REPLY_PREFIX = Header("Reply", ("kind", "B"), ("size", "I"))  # then the body
RECEIPT, STATUS = 1, 2  # a reply's kind: TupleReceipt, LaneStatus (3 is reserved)

# Limits a peer may rely on (docs/lane.md, "Limits")
MAX_HELLO_BYTES = 64 * 1024  # a LaneHello
MAX_STATUS_BYTES = 64 * 1024  # a LaneStatus that ends a download
MAX_REPLY_BYTES = 64 * 1024 * 1024  # any other reply body
HELLO_SECONDS = 10.0  # the TLS handshake and the whole hello arrive within this
DRAIN_SECONDS = 1.0  # after an error status the server reads on this long, then closes
KEEP_SECONDS = 60.0  # a server keeps a connection idle between calls this long (less only when crowded)
REUSE_SECONDS = 20.0  # a client starts a call only on a connection idle for less than this

# A TLS record's first byte (handshake 22, alert 21): what a plaintext peer of a TLS lane reads
TLS_RECORD_TYPES = (0x15, 0x16)
