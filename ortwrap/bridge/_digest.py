"""The digest of a native helper's C source: setup.py embeds it in the extension module it builds
(``ORTWRAP_SOURCE_SHA256``), and ``_native.py`` uses that module only while the source next to it
still has the same digest. Imports nothing from ortwrap: setup.py loads this file on its own.
"""

from __future__ import annotations

import hashlib
import os

_HERE = os.path.dirname(os.path.abspath(__file__))

#: Headers the C sources include (the DLPack ABI that ``_aten.c`` and ``kernels/_cpu.c`` share):
#: part of every digest, and so of the compile cache's key.
HEADERS = (os.path.join(_HERE, "_dlpack.h"),)


def source_digest(source: str) -> str:
    """sha256 (hex) of the C file ``source`` and of :data:`HEADERS`."""
    h = hashlib.sha256()
    for path in (source, *HEADERS):
        with open(path, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()
