"""HTTPS for the pull: the manifest, and the bundle into a ``.part`` file with HTTP Range resume. The standard
library only (``ssl``, ``urllib.request``); the server is verified against ``[update] ca_file`` (or the system's
CAs) with its host name checked, and a redirect may lead only to another https:// URL."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from http.client import HTTPException, HTTPResponse
from pathlib import Path

__all__ = ["MANIFEST_LIMIT", "FetchError", "HttpsOnlyRedirects", "download", "fetch_manifest", "file_sha256",
           "make_opener"]

log = logging.getLogger("gateway.update")

#: A manifest is a few hundred bytes; anything past this is not one.
MANIFEST_LIMIT = 64 * 1024
_CHUNK = 256 * 1024
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class FetchError(Exception):
    """The server could not be reached or verified, or answered something unusable; ``str()`` says which."""


class HttpsOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects (a CDN, a release store) only to https:// URLs: a redirect to plain HTTP would hand the
    manifest, and the choice of bundle, to anyone on the path."""

    def redirect_request(self, req: urllib.request.Request, fp: object, code: int, msg: str, headers: object,
                         newurl: str) -> urllib.request.Request | None:
        if not newurl.lower().startswith("https://"):
            raise FetchError(f"{req.full_url} redirects to {newurl!r}: only https:// is followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)  # type: ignore[arg-type]


def make_opener(context: ssl.SSLContext) -> urllib.request.OpenerDirector:
    """An opener that verifies servers with ``context`` and follows https-only redirects."""
    return urllib.request.build_opener(urllib.request.HTTPSHandler(context=context), HttpsOnlyRedirects())


def _why(exc: BaseException) -> str:
    """One line for a failed request; a certificate that does not verify says so plainly."""
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, ssl.SSLCertVerificationError):
        return f"the server's certificate did not verify: {reason.verify_message or reason}"
    if isinstance(reason, ssl.SSLError):
        return f"TLS failed: {reason.reason or reason}"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__


def fetch_manifest(opener: urllib.request.OpenerDirector, url: str, timeout: float) -> bytes:
    """The manifest's bytes (at most :data:`MANIFEST_LIMIT`).

    Raises:
        FetchError: the connection, TLS or HTTP failed, or the body is too large.
    """
    request = urllib.request.Request(url, headers={"Accept": "application/json", "Cache-Control": "no-cache"})
    try:
        with opener.open(request, timeout=timeout) as response:
            body: bytes = response.read(MANIFEST_LIMIT + 1)
    except urllib.error.HTTPError as exc:
        raise FetchError(f"GET {url}: HTTP {exc.code} {exc.reason}") from None
    except FetchError:
        raise
    except (urllib.error.URLError, OSError, HTTPException) as exc:
        raise FetchError(f"GET {url}: {_why(exc)}") from None
    if len(body) > MANIFEST_LIMIT:
        raise FetchError(f"GET {url}: the manifest is larger than {MANIFEST_LIMIT} bytes")
    return body


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, as lower-case hex."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def download(opener: urllib.request.OpenerDirector, url: str, part: Path, size: int, timeout: float,
             attempts: int = 3, on_attempt: Callable[[int, int], None] | None = None) -> None:
    """Bring ``part`` to exactly ``size`` bytes of ``url``, resuming what is already there with an HTTP Range
    request; a server that answers the whole file (200) instead of the range (206) makes it start again from
    byte 0. Never writes more than ``size`` bytes: a server that offers or sends more is refused. An interrupted
    transfer is retried ``attempts`` times in all, each resuming; what arrived stays in ``part`` for the next run.
    ``on_attempt(attempt, offset)`` is called before each request.

    Raises:
        FetchError: the transfer did not complete (``part`` is kept, except on a full disk, where it is removed
            to give the space back), or the server sent more than ``size`` bytes (``part`` removed).
    """
    last = "no attempt"
    for attempt in range(1, attempts + 1):
        have = part.stat().st_size if part.exists() else 0
        if have > size:
            part.unlink()
            have = 0
        if have == size:
            return
        if on_attempt is not None:
            on_attempt(attempt, have)
        headers = {"Range": f"bytes={have}-"} if have else {}
        request = urllib.request.Request(url, headers=headers)
        try:
            with opener.open(request, timeout=timeout) as response:
                have = _receive(response, part, have, size, url)
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and have:  # the server's file is shorter than our part: it changed, start over
                log.warning("GET %s: HTTP 416 for bytes=%d-: starting the download again", url, have)
                part.unlink(missing_ok=True)
                last = "HTTP 416"
                continue
            raise FetchError(f"GET {url}: HTTP {exc.code} {exc.reason}") from None
        except FetchError:
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                part.unlink(missing_ok=True)
                raise FetchError(f"writing {part}: {exc.strerror}; the part was removed to give the space back "
                                 "to the store") from None
            last = _why(exc)
        except (urllib.error.URLError, HTTPException) as exc:
            last = _why(exc)
        else:
            if have == size:
                return
            last = "the connection closed early"
        got = part.stat().st_size if part.exists() else 0
        log.warning("GET %s: interrupted at %d of %d bytes (%s)%s", url, got, size, last,
                    "; resuming" if attempt < attempts else "")
    got = part.stat().st_size if part.exists() else 0
    raise FetchError(f"GET {url}: incomplete after {attempts} attempts, {got} of {size} bytes ({last}); the next "
                     "run resumes")


def _receive(response: HTTPResponse, part: Path, have: int, size: int, url: str) -> int:
    """Write one response's body into ``part``; returns the bytes ``part`` then holds."""
    status, headers, read = response.status, response.headers, response.read
    mode = "ab"
    if have and status == 206:
        m = _CONTENT_RANGE.match(headers.get("Content-Range", ""))
        if not m or int(m.group(1)) != have or (m.group(3) != "*" and int(m.group(3)) != size):
            raise FetchError(f"GET {url}: Content-Range {headers.get('Content-Range')!r} does not continue at byte "
                             f"{have} of {size}")
    elif status == 200:
        if have:
            log.warning("GET %s: the server ignored Range (HTTP 200 to bytes=%d-): downloading from byte 0", url, have)
        mode, have = "wb", 0
    else:
        raise FetchError(f"GET {url}: unexpected HTTP {status}")
    length = headers.get("Content-Length")
    if length is not None and length.isdigit() and have + int(length) > size:
        part.unlink(missing_ok=True)
        raise FetchError(f"GET {url}: the server offers {have + int(length)} bytes, the manifest says {size}: "
                         "refused")
    with part.open(mode) as f:
        while have < size:
            chunk = read(min(_CHUNK, size - have))
            if not chunk:
                break
            f.write(chunk)
            have += len(chunk)
        f.flush()
        os.fsync(f.fileno())
        if have == size and read(1):
            f.close()
            part.unlink(missing_ok=True)
            raise FetchError(f"GET {url}: the server sent more than the manifest's size {size}: refused")
    return have
