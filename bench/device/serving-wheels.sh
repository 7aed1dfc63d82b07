#!/usr/bin/env bash
# The serving dependencies as wheels for the GPU machine's Python (CPython 3.12, manylinux x86-64),
# with their own dependencies as pip resolves them, into DIR (carried beside the tree and installed by
# bench/device/wheels.sh):
#   bench/device/serving-wheels.sh [DIR]        # default .whl_web
# The project's base dependencies (pyproject.toml) and xgrammar without its dependencies (torch,
# transformers, triton: the image's); then the wheels of packages the GPU image already holds
# (IMAGE_HAS, from the device notes' package list; not the pinned gRPC packages, whose versions
# matter) are dropped, to stay within the carry limit beside FlashInfer's wheels. A hand-picked list
# once missed a new dependency of fastapi (opentelemetry-api), which left `serve` unable to start on
# the GPU host.
set -euo pipefail
DIR=${1:-.whl_web}
mkdir -p "$DIR"
IMAGE_HAS="numpy tokenizers jinja2 certifi click httpcore httpx idna prometheus_client psutil pyyaml setuptools tqdm
           uvloop xxhash"
deps=$(python3 - "$IMAGE_HAS" <<'PY'
import re, sys, tomllib
has = {n.replace("_", "-") for n in sys.argv[1].split()}
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for dep in project["dependencies"]:
    if re.split(r"[<>=!\[ ;~]", dep)[0].lower().replace("_", "-") not in has:
        print(dep)
PY
)
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
        --platform any)
# shellcheck disable=SC2086
python3 -m pip download -q "${target[@]}" -d "$DIR" $deps
python3 -m pip download -q "${target[@]}" --no-deps -d "$DIR" "$(grep -o '"xgrammar==[^"]*"' pyproject.toml | tr -d '"')"
for name in $IMAGE_HAS; do rm -f "$DIR/$name"-[0-9]*.whl; done
du -sh "$DIR"
