"""The page at / in a real headless browser (Debian's Chromium): a screenshot of a
streamed answer must show drafted-and-accepted tokens marked apart from the target's."""

from __future__ import annotations

import shutil
import struct
import subprocess
import urllib.parse
import zlib

import httpx
from specdec.testing import require_command

#: The page's colour for drafted-and-accepted tokens (``.draft`` in page.html).
DRAFT_RGB = (0xB7, 0xF0, 0xC0)
PROMPT = "Repeat this list exactly: apples, pears, plums, apples, pears, plums."


def _chromium() -> str:
    """Debian's ``chromium`` (Ubuntu's ``chromium-browser``): skips outside CI, fails in CI."""
    return shutil.which("chromium-browser") or require_command("chromium")


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """``(width, height, rows)`` of an 8-bit RGB or RGBA, non-interlaced PNG; each row
    is ``width * 3`` bytes of RGB."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        prev = line
        rgb = bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3)
        rows.append(rgb)
    return width, height, rows


def _count(rows: list[bytes], pred) -> int:
    n = 0
    for row in rows:
        for x in range(0, len(row), 3):
            if pred(row[x], row[x + 1], row[x + 2]):
                n += 1
    return n


def test_the_page_streams_an_answer_with_drafted_tokens_marked(server, tmp_path):
    base, engine = server
    chromium = _chromium()
    query = urllib.parse.urlencode({"prompt": PROMPT, "max": 40, "policy": "copy", "autorun": 1})
    url = f"{base}/?{query}"
    shot = tmp_path / "page.png"
    common = [
        chromium,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=900,700",
        "--virtual-time-budget=60000",
    ]
    subprocess.run(
        [*common, f"--screenshot={shot}", url], check=True, timeout=180, capture_output=True
    )
    dom = subprocess.run(
        [*common, "--dump-dom", url], check=True, timeout=180, capture_output=True, text=True
    ).stdout
    assert "(done)" in dom, dom[-2000:]  # the stream ended in the browser
    assert 'class="draft"' in dom and 'class="target"' in dom
    width, height, rows = read_png(shot.read_bytes())
    assert (width, height) == (900, 700)
    near = lambda r, g, b: all(abs(v - w) <= 12 for v, w in zip((r, g, b), DRAFT_RGB))  # noqa: E731
    dark = lambda r, g, b: r < 90 and g < 90 and b < 90  # noqa: E731
    green, text = _count(rows, near), _count(rows, dark)
    # drafted tokens drawn on their background, and text drawn at all
    assert green > 500, green
    assert text > 500, text
    # the server is still healthy after the browser's requests
    assert httpx.get(base + "/health").json()["status"] == "ok"
