#!/usr/bin/env bash
# Creates the PyTorch + transformers reference environment that benchmarks/train_step.py,
# benchmarks/step_anatomy.py and benchmarks/rollout.py compare against (never a dependency of the
# package): a venv on Python 3.12 with every package pinned in requirements.txt beside this file.
#
#   benchmarks/reference/setup.sh [VENV_DIR] [PYTHON]      (or: make reference-env)
#
# VENV_DIR: where the venv goes, any folder you choose (default /work/refvenv); pass the same folder
# to what uses it (--hf-python VENV_DIR/bin/python). PYTHON: python3.12 on PATH, else pyenv's newest 3.12.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-/work/refvenv}
py=${2:-}
if [ -z "$py" ]; then
  if command -v python3.12 >/dev/null && python3.12 -c '' 2>/dev/null; then
    py=$(command -v python3.12)
  elif command -v pyenv >/dev/null && pyenv versions --bare | grep -q '^3\.12'; then
    py="$(pyenv root)/versions/$(pyenv versions --bare | grep '^3\.12' | sort -V | tail -1)/bin/python"
  fi
fi
if [ -z "$py" ] || ! "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
  echo "setup.sh: no Python 3.12 found (got '${py:-nothing}'): pass its path as the second argument," >&2
  echo "  e.g. benchmarks/reference/setup.sh $venv ~/.pyenv/versions/3.12.1/bin/python" >&2
  exit 2
fi
test -x "$venv/bin/python" || "$py" -m venv "$venv"
# A machine may cap torch in a global pip constraints file (e.g. under /etc/xdg/pip) below the pin;
# this environment pins its own versions, so such a cap is set aside for this install only.
PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt"
"$venv/bin/python" -c 'import platform, torch, transformers; from transformers import Qwen3_5MoeForCausalLM
print(f"reference env: python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")'
echo "use it as: --hf-python $venv/bin/python"
