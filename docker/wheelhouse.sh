#!/bin/sh
# Fill docker/wheelhouse/ with the wheels the offline image build installs (Dockerfile, OFFLINE=1): torch,
# the project's dependencies and its build backend, from whatever this machine's pip can reach (its index,
# mirror or find-links: `pip config list`). Wheels that exist only as sources (fastecdsa) are built here, so
# the image build compiles nothing; this needs libgmp-dev, as `make install` does.
#   docker/wheelhouse.sh            PY (default: .venv/bin/python, else python3) must be the image's Python
#                                   minor version (3.11 on bookworm): pip picks wheels for the Python it runs.
# TORCH_VERSION (default 2.13.0). Only a CPU torch is accepted: a CUDA build would pull GBs of nvidia wheels.
set -eu
cd "$(dirname "$0")/.."
out=docker/wheelhouse
torch=${TORCH_VERSION:-2.13.0}
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
want=${PYTHON_MINOR:-3.11}
have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$have" = "$want" ] || { echo "wheelhouse.sh: $PY is Python $have, the image's is $want (set PY)" >&2; exit 2; }
mkdir -p "$out"
log=$(mktemp); trap 'rm -f "$log"' EXIT
# pip's output goes to a log shown on failure only (a configured find-links or index may warn per package).
pip_() { "$PY" -m pip "$@" >"$log" 2>&1 || { tail -30 "$log" >&2; exit 1; }; }
# torch alone first, without dependencies, to check which build pip picked before fetching anything else.
pip_ download --no-deps --only-binary=:all: --dest "$out" "torch==$torch"
wheel=$(ls "$out"/torch-"$torch"*.whl | head -n 1)
case "$wheel" in
  *+cpu*) ;;
  *) echo "wheelhouse.sh: pip found $wheel, not a CPU build (torch==$torch+cpu); put the CPU wheel in a" \
          "find-links directory or set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2
     rm -f "$wheel"; exit 2 ;;
esac
# The rest: the project and its dependencies (torch resolves to the wheel above), and the build backend that
# `pip install /src` needs in the image. The project's own wheel is left out: the image builds it from /src.
pip_ wheel --wheel-dir "$out" --find-links "$out" "$wheel" . 'setuptools>=68' wheel
rm -f "$out"/starling-*.whl
if ls "$out" | grep -q '^nvidia_'; then echo "wheelhouse.sh: CUDA packages in $out; remove them" >&2; exit 2; fi
echo "wheelhouse: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
