#!/usr/bin/env bash
# The wheels `make gpu-check` needs on an offline GPU machine (Python 3.12, torch 2.11): what
# its image lacks of mt's dependencies. Run on a machine with network, in the repository's root;
# the folders .whl and .gpu-data are git-ignored: carry them to the GPU machine with the tree.
#     bash scripts/gpu_wheels.sh            # -> .whl/*.whl and .gpu-data/ (the corpora)
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
grep -qx '/.gpu-data/' "$exclude" 2>/dev/null || echo '/.gpu-data/' >> "$exclude"
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform any)
# antlr4 (omegaconf's parser) publishes no wheel: built here as a pure-Python one.
python3 -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d .whl "hydra-core>=1.3" "omegaconf>=2.2,<2.4" sacremoses
DATA="${MT_DATA_DIR:-../shared/data}"
mkdir -p .gpu-data
for corpus in multi30k wmt14 wmt_newstest_de-en; do cp -r "$DATA/$corpus" .gpu-data/; done
du -sh .whl .gpu-data
