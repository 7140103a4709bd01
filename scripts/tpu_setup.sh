#!/usr/bin/env bash
# Set the project up on a TPU host whose JAX and libtpu are already installed (a TPU VM image, or
# `pip install 'jax[tpu]'` done by you): the project's other dependencies go into .tpu-site/ in this
# checkout, behind the host's own packages on the path, so the host's JAX is the one imported.
#
#   scripts/tpu_setup.sh                 # from the host's own package index where it has one
#                                        # (/opt/pypi/simple), else from PyPI at the pinned versions
#   scripts/tpu_setup.sh --index URL     # from another index
#   source .tpu-env                      # then: python3 -m hybridmoe ..., python3 -m pytest --chip
#
# Nothing outside the checkout is written; running it again installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
site=$root/.tpu-site
index=""
if [ "${1:-}" = "--index" ]; then index=$2; elif [ -d /opt/pypi/simple ]; then index=file:///opt/pypi/simple; fi

python3 -c 'import jax; print("host JAX", jax.__version__, "sees", jax.devices())' || {
  echo "tpu_setup: this host's python3 has no working JAX; install jax[tpu] first (docs/tpu.md)" >&2; exit 2; }

# The project's dependencies and the test tools, less JAX itself (the host's is kept).
mapfile -t wanted < <(python3 - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = p["dependencies"] + [d for d in p["optional-dependencies"]["test"] if not d.startswith("jax")]
for d in deps:
    if d.split("==")[0].split("[")[0] not in ("jax", "jaxlib", "numpy"):
        print(d)
PY
)
if [ -n "$index" ]; then
  # A local index holds what it holds: the names, at the versions it has.
  names=("${wanted[@]%%==*}")
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url "$index" \
    --target "$site" --upgrade "${names[@]}"
else
  python3 -m pip install -q --target "$site" --upgrade "${wanted[@]}"
fi
# pip brings JAX and what it is built against along with optax and orbax: drop them, so that the host's
# own (whose libtpu matches its jaxlib) is the only one, wherever it sits on the path.
( cd "$site" && rm -rf jax jaxlib libtpu numpy ml_dtypes opt_einsum scipy scipy.libs numpy.libs \
    jax-*.dist-info jaxlib-*.dist-info libtpu-*.dist-info numpy-*.dist-info ml_dtypes-*.dist-info \
    opt_einsum-*.dist-info scipy-*.dist-info )
cat > "$root/.tpu-env" <<ENV
# source this file: the host's packages first, then the project's dependencies, then the project.
export PYTHONPATH=\${PYTHONPATH:+\$PYTHONPATH:}$site:$root
ENV
# shellcheck disable=SC1091
source "$root/.tpu-env"
python3 - <<'PY'
import jax, hybridmoe.cli, optax, orbax.checkpoint, pydantic  # noqa: F401
site = __import__("os").path.realpath(".tpu-site")
assert not jax.__file__.startswith(site), f"JAX imported from {jax.__file__}, not the host's"
print("hybridmoe ready; the host's JAX", jax.__version__, "from", jax.__file__)
PY
