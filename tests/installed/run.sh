#!/usr/bin/env bash
# Usage: tests/installed/run.sh PYTHON ARTIFACT EXTRA TORCH
# Installs ARTIFACT (a wheel or an sdist of ortwrap), not editable, into a fresh venv made by PYTHON:
# torch==TORCH first (pinned), then ortwrap[EXTRA] from ARTIFACT. Runs test_installed.py there from a
# temporary directory outside the checkout (the source tree is not importable), with CC naming no
# compiler and empty caches. `make test-wheel` runs it for the wheel and the sdist.
set -euo pipefail
python=$1
artifact=$(realpath "$2")
extra=$3
torch=$4
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/ortwrap-installed.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
"$python" -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q "torch==$torch"
# --no-cache-dir: pip caches the wheel it builds from an sdist under the sdist's URL; a later sdist of the same
# version at the same path (a clone in the same place, rebuilt) would install that stale wheel instead.
"$py" -m pip install -q --no-cache-dir "ortwrap[$extra] @ file://$artifact" pytest
echo ">> $(basename "$artifact") installed in $(( $(date +%s) - start )) s"
cp "$here/test_installed.py" "$work/"
cd "$work"
CC=/nonexistent/cc ORTWRAP_CACHE_DIR="$work/cache" ORTWRAP_BUILD_CACHE_DIR="$work/builds" ORTWRAP_TEST_INSTALLED=1 \
    "$py" -m pytest -q -p no:cacheprovider test_installed.py
