"""A small multipart/form-data reader over a buffered body: where each field's value lies.

Values are located, not copied: an audio upload of many megabytes is sliced only if asked for.
"""
from __future__ import annotations

from dataclasses import dataclass


class MultipartError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Field:
    start: int  # the value is body[start:end]
    end: int
    filename: str | None


def boundary(content_type: bytes) -> bytes:
    """The boundary parameter of a multipart/form-data Content-Type."""
    kind, _, params = content_type.partition(b";")
    if kind.strip().lower() != b"multipart/form-data":
        raise MultipartError("Content-Type must be multipart/form-data.")
    found = None
    for param in params.split(b";"):
        key, _, value = param.strip().partition(b"=")
        if key.lower() == b"boundary":
            if found is not None:  # vLLM's form parser takes the last one, we would take the first
                raise MultipartError("multipart/form-data with more than one boundary.")
            found = value.strip(b'"')
    if found is None or not 0 < len(found) <= 200:
        raise MultipartError("multipart/form-data without a valid boundary.")
    return found


def _disposition(headers: bytes) -> tuple[str, str | None]:
    for line in headers.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() != b"content-disposition":
            continue
        name = filename = None
        for param in value.split(b";")[1:]:
            k, _, v = param.strip().partition(b"=")
            v = v.strip().strip(b'"').decode("utf-8", "replace")
            if k.lower() == b"name":
                name = v
            elif k.lower() == b"filename":
                filename = v
        if name is not None:
            return name, filename
    raise MultipartError("A multipart part has no Content-Disposition name.")


def fields(body: bytes, content_type: bytes, once: tuple[str, ...] = ()) -> dict[str, Field]:
    """Every field of the form (the first of each name). A name in `once` given twice is an error:
    the replica's form parser keeps the last value, so routing by the first could misroute."""
    delimiter = b"--" + boundary(content_type)
    # The body begins with the boundary, after blank lines at most, as python-multipart (vLLM's
    # form parser) insists: a preamble we skipped could hold the form vLLM reads.
    pos = 0
    while body[pos:pos + 1] in (b"\r", b"\n"):
        pos += 1
    if not body.startswith(delimiter, pos):
        raise MultipartError("The multipart body does not begin with its boundary.")
    found: dict[str, Field] = {}
    while True:
        pos += len(delimiter)
        if body.startswith(b"--", pos):
            return found
        if not body.startswith(b"\r\n", pos):
            raise MultipartError("Malformed multipart body.")
        head_end = body.find(b"\r\n\r\n", pos + 2)
        if head_end < 0:
            raise MultipartError("Malformed multipart body: a part's headers do not end.")
        name, filename = _disposition(body[pos + 2:head_end])
        start = head_end + 4
        end = body.find(b"\r\n" + delimiter, start)
        if end < 0:
            raise MultipartError("Malformed multipart body: the last part is not closed.")
        if name in once and name in found:
            raise MultipartError(f"Form field `{name}` is given more than once.")
        found.setdefault(name, Field(start, end, filename))
        pos = end + 2
