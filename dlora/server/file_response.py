"""A stored file's bytes, Range requests included, with OpenAI's error shape for a bad Range header."""

from __future__ import annotations

from starlette.responses import FileResponse, MalformedRangeHeader, RangeNotSatisfiable

from dlora.server.errors import APIError


class FileContent(FileResponse):
    """Starlette's FileResponse, whose own answers to a Range header it cannot serve are plain text:
    here they are the same statuses (400 malformed, 416 past the end, with `Content-Range`) as the
    JSON error every other refusal is. Starlette parses the header while sending the response, still
    inside the route's exception handling, so an APIError raised there is answered as the route's."""

    @classmethod
    def _parse_range_header(cls, http_range: str, file_size: int) -> list[tuple[int, int]]:
        try:
            return super()._parse_range_header(http_range, file_size)
        except MalformedRangeHeader as e:
            raise APIError(400, f"Range header: {e.content.removeprefix('Range header: ')}", "range") from None
        except RangeNotSatisfiable as e:
            raise APIError(
                416,
                f"Range header: no requested range starts within the file's {e.max_size} bytes",
                "range",
                headers={"Content-Range": f"bytes */{e.max_size}"},
            ) from None
