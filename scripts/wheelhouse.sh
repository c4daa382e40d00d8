#!/usr/bin/env bash
# Makes a wheelhouse for the service image (Dockerfile, build arg WHEELHOUSE): every dependency of
# kernelmode as a wheel, plus setuptools (to build kernelmode itself from the copied source) and
# pip, in one directory of the checkout (default wheelhouse/, git-ignored). With it the image
# builds with no package index and no apt (pip --no-index --find-links):
#
#   make wheelhouse                                  # where PyPI (or your mirror) is reachable
#   WHEELHOUSE=wheelhouse BASE_IMAGE=kernelmode/base:bookworm BUILD_NETWORK=none docker compose build kernelmode
#
# Uses the pip of $PYTHON (default .venv/bin/python, else python3) with its own configuration
# (index, mirror, cache): a second run is served from pip's cache. The wheels must fit the
# image's Python (CPython 3.11, linux, the host's architecture): run it with a Python 3.11.
# kernelmode's own wheel is left out: the image builds it from the source it copies, so the
# wheelhouse (and the image layer that installs it) changes only when the dependencies do.
#
# Usage: scripts/wheelhouse.sh [DIR]
set -euo pipefail

cd "$(dirname "$0")/.."
DIR="${1:-wheelhouse}"
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"

version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$version" != 3.11 ]; then
  echo "wheelhouse: warning: $PYTHON is Python $version; the images' Python is 3.11, so compiled" \
       "wheels may not install there (PYTHON=python3.11 $0)" >&2
fi
# Two passes. 1: `pip wheel` resolves on this Python and builds a wheel of whatever is published
# as a source archive only (and of kernelmode). 2: `pip download --python-version` resolves again
# for the image's Python ($TARGET_PYTHON, default 3.11.2: Debian bookworm's, the oldest of the
# two bases; python:3.11-slim is a later 3.11), taking those built wheels from pass 1: a release
# that needs a later 3.11 (soupsieve asks >=3.11.5) is replaced by one that installs there.
TARGET_PYTHON="${TARGET_PYTHON:-3.11.2}"
tmp=$(mktemp -d /tmp/kernelmode-wheels.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
built="$tmp/wheels"
# From a copy of what the image copies (setuptools builds in the source tree: no build/ here).
mkdir -p "$tmp/src/kernel-image"
cp -a pyproject.toml README.md kernelmode "$tmp/src/"
cp -a kernel-image/requirements.txt kernel-image/ipython_kernel_config.json "$tmp/src/kernel-image/"
"$PYTHON" -m pip wheel -q --disable-pip-version-check --no-input --wheel-dir "$built" \
  "$tmp/src" 'setuptools>=68' pip
rm -rf "$DIR"
mkdir -p "$DIR"
"$PYTHON" -m pip download -q --disable-pip-version-check --no-input --dest "$DIR" \
  --find-links "$built" --only-binary=:all: --python-version "$TARGET_PYTHON" \
  "$(ls "$built"/kernelmode-*.whl)" 'setuptools>=68' pip
rm -f "$DIR"/kernelmode-*.whl
echo "wheelhouse: $(find "$DIR" -name '*.whl' | wc -l) wheels for Python $TARGET_PYTHON in $DIR" \
     "($(du -sh "$DIR" | cut -f1))"
