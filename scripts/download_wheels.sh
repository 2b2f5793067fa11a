#!/usr/bin/env bash
# Download every wheel `mt` needs for an offline machine (an air-gapped GPU cluster, say) that
# has its own Python and torch. Run it on a connected machine, copy the folder over, then there:
#     make install VENV= WHEELS=wheels        # into the machine's own Python, torch untouched
# or  make install WHEELS=wheels              # into a new .venv (torch must be among the wheels)
#
# Usage: scripts/download_wheels.sh [PYTHON_VERSION] [DIR]   (default: 3.12 wheels)
# Set WITH_TORCH=torch==2.11.0 to add a torch wheel (large; most GPU machines have one).
set -euo pipefail
PYVER="${1:-3.12}"
DIR="${2:-wheels}"
cd "$(dirname "$0")/.."
mkdir -p "$DIR"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform any)
# 1. mt itself and the pure-Python sdists that publish no wheel, built here as py3 wheels.
python3 -m pip wheel -q --no-deps -w "$DIR" . "antlr4-python3-runtime==4.9.3"
# 2. Everything else as binary wheels for the target interpreter (torch excluded by default).
reqs=$(python3 - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = p["dependencies"] + p["optional-dependencies"]["all"] + p["optional-dependencies"]["dev"]
print(" ".join(d for d in deps if not d.startswith("torch")))
PY
)
# shellcheck disable=SC2086
python3 -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" --find-links "$DIR" -d "$DIR" $reqs hatchling ${WITH_TORCH:-}
echo "wheels for Python $PYVER in $DIR: $(ls "$DIR" | wc -l) files"
