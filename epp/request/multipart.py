"""The text fields of a ``multipart/form-data`` body (RFC 7578), for the APIs that take
uploads (``/v1/audio/transcriptions``, ``/v1/audio/translations``): epp needs their ``model``
and nothing of the file.

The scan finds each part's delimiter with ``bytes.find`` (C speed, the file's bytes are never
copied or decoded) and reads the headers of at most :data:`MAX_PARTS` parts, each header block
at most :data:`MAX_HEADER_BYTES`; a text field's value is kept when it is at most
:data:`MAX_VALUE_BYTES`. Where each kept value lies in the body is remembered, so a model
rewrite replaces those bytes and forwards the rest as it came.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from epp.errors import BadRequest

MAX_PARTS = 256
MAX_HEADER_BYTES = 16 * 1024
MAX_VALUE_BYTES = 4 * 1024
_BOUNDARY = re.compile(r'boundary=(?:"([^"]{1,200})"|([^\s;,"]{1,200}))', re.IGNORECASE)
_NAME = re.compile(rb'[;\s]name="([^"]*)"', re.IGNORECASE)
_FILENAME = re.compile(rb"[;\s]filename\*?=", re.IGNORECASE)


@dataclass(slots=True)
class Form:
    """The text fields of a form (name -> value, the first of a repeated name) and where
    each value's bytes are in the body."""

    fields: dict[str, str] = field(default_factory=dict)
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)

    def replace(self, body: bytes, name: str, value: str) -> bytes:
        """``body`` with field ``name``'s value replaced by ``value``."""
        start, end = self.spans[name]
        return body[:start] + value.encode() + body[end:]


def is_form(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "multipart/form-data"


def read_form(body: bytes, content_type: str) -> Form:
    """The text fields of ``body``; BadRequest when it is no well-formed form."""
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise BadRequest("content-type multipart/form-data without a boundary")
    delimiter = b"--" + (m.group(1) or m.group(2)).encode("latin-1")
    pos = body.find(delimiter)
    if pos < 0:
        raise BadRequest("multipart body holds no part of its boundary")
    form = Form()
    next_delimiter = b"\r\n" + delimiter
    for _ in range(MAX_PARTS):
        pos += len(delimiter)
        if body.startswith(b"--", pos):
            return form  # the closing delimiter
        head_start = body.find(b"\r\n", pos)
        if head_start < 0:
            break
        head_end = body.find(b"\r\n\r\n", head_start, head_start + MAX_HEADER_BYTES)
        if head_end < 0:
            raise BadRequest("a multipart part's headers are missing or too long")
        end = body.find(next_delimiter, head_end + 4)
        if end < 0:
            break
        headers = body[head_start:head_end]
        name = _NAME.search(headers)
        start = head_end + 4
        if (name is not None and _FILENAME.search(headers) is None
                and end - start <= MAX_VALUE_BYTES):  # fmt: skip
            key = name.group(1).decode("utf-8", "replace")
            if key not in form.fields:
                try:
                    form.fields[key] = body[start:end].decode("utf-8")
                except UnicodeDecodeError:
                    raise BadRequest(f"multipart field {key!r} is not valid UTF-8") from None
                form.spans[key] = (start, end)
        pos = end + 2
    else:
        raise BadRequest(f"multipart body has more than {MAX_PARTS} parts")
    raise BadRequest("multipart body ends before its closing boundary")
