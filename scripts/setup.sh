#!/usr/bin/env bash
# One setup: installs what fxpar and its tests need on a bare Debian machine, run as root (or
# as a user with sudo). The README's two commands and .ci/run both start with it; running it
# again changes nothing that is already installed.
#
#     bash scripts/setup.sh
#
# System packages: graphviz's `dot` renders the plan and graph pictures; chromium (headless)
# loads the HTML report in tests/test_report.py.
# Python packages: torch pinned to the version the tests were run with (unpinned, pip would pull
# a multi-GB CUDA build where the pin resolves to the CPU wheel); numpy, which
# torch.distributed.pipelining and torch.export need at run time; fxpar itself, editable, with
# the test extra (pytest, the pinned transformers, matplotlib for the charts).
# On a CUDA machine install the torch build for your CUDA first and run
# `FXPAR_TORCH=torch bash scripts/setup.sh`: the requirement `torch` keeps the installed build.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
if command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get -q update
    $sudo apt-get -q install -y --no-install-recommends graphviz chromium
else
    echo "setup: no apt-get here; install graphviz (its dot program) and chromium with this" \
         "system's package manager" >&2
fi

export PIP_ROOT_USER_ACTION=ignore  # root on a bare machine or in CI is intended: no warning
python3 -m pip install "${FXPAR_TORCH:-torch==2.13.0}"
python3 -m pip install numpy
python3 -m pip install -e '.[test]'

# What the tests will run with (apt-get above fails the script if a system package is missing).
python3 --version
python3 -c 'import torch; print("torch", torch.__version__)'
dot -V || echo "setup: graphviz's dot is missing: the picture tests will fail" >&2
chromium --version || echo "setup: chromium is missing: the report's browser test will skip" >&2
