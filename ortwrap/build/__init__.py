"""Stage 3: the build. ``compile_program`` turns a module and one input schema into a
``runtime.program.Program`` and its ``BuildArtifacts``.

- ``pipeline.py``: stages as data (``Stage``, ``run_stages``);
- ``request.py``: what a build is asked (``BuildRequest``) and gives back (``BuildArtifacts``);
- ``stages.py``: the one stage plan (``export_stages``, ``build_stages``);
- ``compile.py``: ``compile_program``, the exporter loop, the garbage collector set aside;
- ``cache.py``: the persistent build cache (key, signed entries, size cap);
- ``cache_stages.py``: its stages (lookup, store, a program from an entry).
"""

from __future__ import annotations

from .compile import compile_program
from .request import BuildArtifacts, BuildRequest

__all__ = ["BuildArtifacts", "BuildRequest", "compile_program"]
