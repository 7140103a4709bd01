#!/usr/bin/env bash
# MaxText (the peer of benchmarks/peer_maxtext.py) for a host without a package registry, on Python 3.11.
#
#   scripts/maxtext_wheels.sh fetch   [DIR]   # here, with a registry: the wheels into DIR (default .maxtext-wheels)
#   scripts/maxtext_wheels.sh install [DIR]   # there: DIR's wheels into .maxtext-site (no index, no dependencies)
#   python3 benchmarks/peer_maxtext.py --maxtext-site .maxtext-site      # after `source .tpu-env`
#
# MaxText 0.2.5 and flax 0.12.9 declare Python >= 3.12 (and MaxText JAX >= 0.11.1): both are installed
# with --ignore-requires-python, and benchmarks/peer_maxtext.py applies the two shims that makes them
# import on Python 3.11 with JAX 0.10.2 (docs/tpu.md, "A peer on the chip: MaxText"). tokamax is held
# at 0.0.12, the last release that is Python 3.11 source (0.0.13 on use PEP 695 generics throughout);
# MaxText imports it but calls it only under use_tokamax_gmm / use_tokamax_splash, both off here.
# Every wheel goes in with --no-deps at the version below: what the list leaves out comes from the
# host's packages and .tpu-site (JAX, optax, orbax, pydantic, PyYAML, tokenizers, safetensors, ...).
# .maxtext-site is a folder of its own, put first on the path (the v5e host's own antlr4 and
# huggingface-hub are at versions MaxText's imports refuse); JAX is not among its wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:?"usage: scripts/maxtext_wheels.sh fetch|install [DIR]"}
dir=${2:-.maxtext-wheels}

# What MaxText's Qwen3.5 training path imports, beyond this project's own dependencies.
WHEELS=(
  maxtext==0.2.5 flax==0.12.9 tokamax==0.0.12 qwix==0.1.8 aqtp==0.9.0 drjax==0.2.1 grain==0.2.18
  omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 treescope==0.1.10 rich==15.0.0 markdown-it-py==4.3.0
  mdurl==0.1.2 pygments==2.21.0 pathwaysutils==0.1.13 fastapi==0.165.0 starlette==1.10.0 anyio==4.16.0
  sniffio==1.3.1 annotated-doc==0.0.7 opentelemetry-api==1.45.3 importlib-metadata==10.2.0 zipp==4.1.2
  uvicorn==0.55.0 h11==0.16.0 click==8.5.1 transformers==5.25.0 regex==2026.12.2 typer==0.29.2
  shellingham==1.5.4 einshape==1.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 immutabledict==4.3.1
  typeguard==2.13.3 cloudpickle==3.1.3 portpicker==1.6.0 array-record==0.8.6 tiktoken==0.14.0
  sentencepiece==0.2.3 sympy==1.14.0 mpmath==1.4.1 ml-collections==1.1.0
  # Imported on the way (huggingface_hub by transformers; the rest by it, grain and pathwaysutils); in
  # this project's CPU environment they came with its dependencies, on a TPU host they may not.
  huggingface-hub==2.4.0 httpx2==2.17.0 httpcore2==2.17.0 filelock==4.3.2 requests==2.34.2 urllib3==2.8.0
  idna==3.21 certifi==2026.10.19.post1 charset-normalizer==3.5.3 truststore==0.10.5 humanize==4.17.0
  psutil==7.2.2 simplejson==4.3.0 prometheus-client==0.26.0 packaging==26.4 etils==1.15.0 msgpack==1.2.4
)

case $what in
  fetch)
    mkdir -p "$dir"
    for w in "${WHEELS[@]}"; do
      if [ "$w" = antlr4-python3-runtime==4.9.3 ]; then  # published as source only: built here (pure Python)
        python3 -m pip wheel -q --no-deps "$w" -w "$dir"
      else
        python3 -m pip download -q --no-deps --only-binary=:all: --ignore-requires-python --python-version 3.11 \
          --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any "$w" -d "$dir"
      fi
    done
    ls "$dir" | wc -l; du -sh "$dir" ;;
  install)
    python3 -m pip install -q --no-index --no-deps --ignore-requires-python --target .maxtext-site --upgrade "$dir"/*.whl
    python3 benchmarks/peer_maxtext.py --help >/dev/null  # the script itself loads
    PYTHONPATH=$PWD/.maxtext-site:${PYTHONPATH:+$PYTHONPATH:}$PWD/benchmarks python3 -c '
import sys, peer_maxtext
mod, why, shims = peer_maxtext.import_maxtext(".maxtext-site")
print("maxtext imports:", mod is not None, why or "", shims)
sys.exit(0 if mod else 2)' ;;
  *) echo "usage: scripts/maxtext_wheels.sh fetch|install [DIR]" >&2; exit 2 ;;
esac
