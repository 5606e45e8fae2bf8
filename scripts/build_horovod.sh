#!/usr/bin/env bash
# Build Horovod (CPU, gloo, no MPI) for the torch and TensorFlow in a venv, and install it there.
#   scripts/build_horovod.sh VENV
# Horovod 0.28.1, its last release, needs three fixes to build against torch 2.x and TF 2.21:
# C++17 instead of C++14, and leaving out xla_mpi_ops.cc (GPU-only code that fails on a missing
# header). The wheel is built once per (Horovod, torch, TF, Python) and kept in the user's cache
# directory; later runs install the cached wheel. If the TensorFlow half cannot be built, a
# torch-only Horovod is built instead and said so; the reverse the same way. Safe to run again.
set -euo pipefail
venv="${1:?usage: build_horovod.sh VENV}"
py="$venv/bin/python"
hvd_version="${UNIFIT_HOROVOD_VERSION:-0.28.1}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/unifit/wheels"

version_of() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo none; }
torch_v="$(version_of torch)"
tf_v="$(version_of tensorflow-cpu)"
[ "$tf_v" != none ] || tf_v="$(version_of tensorflow)"
pyv="$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
key="horovod-$hvd_version-torch$torch_v-tf$tf_v-$pyv"

if "$py" -c "import horovod, sys; sys.exit(horovod.__version__ != '$hvd_version')" 2>/dev/null \
   && [ -f "$venv/.unifit-$key" ]; then
  exit 0
fi

pip=("$py" -m pip install --quiet --disable-pip-version-check)
if ! ls "$cache/$key"/horovod-*.whl >/dev/null 2>&1; then
  echo "build_horovod.sh: building Horovod $hvd_version for torch $torch_v, tensorflow $tf_v (a few minutes, once)" >&2
  "${pip[@]}" "cmake>=3.13,<4" cloudpickle psutil pyyaml packaging  # CMake 4 refuses gloo's old minimum
  work="$(mktemp -d "${TMPDIR:-/tmp}/unifit-horovod.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$work" "horovod==$hvd_version"
  tar -xzf "$work"/horovod-"$hvd_version".tar.gz -C "$work"
  src="$work/horovod-$hvd_version"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  sed -i 's|^\(\s*list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\)|# \1|' \
    "$src/horovod/tensorflow/CMakeLists.txt"
  if grep -q 'CMAKE_CXX_STANDARD 14' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt" \
     || grep -q '^\s*list(APPEND TF_SOURCES .*xla_mpi_ops.cc' "$src/horovod/tensorflow/CMakeLists.txt"; then
    echo "build_horovod.sh: Horovod $hvd_version's CMake files changed; the build fixes did not apply" >&2
    exit 1
  fi
  common=(HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo HOROVOD_WITHOUT_MXNET=1
          MAKEFLAGS="-j$(nproc)" CMAKE_POLICY_VERSION_MINIMUM=3.5 PATH="$venv/bin:$PATH")
  build() {  # build FRAMEWORK-FLAGS...: one wheel into $work/wheel
    rm -rf "$work/wheel" "$src/build"
    (cd "$src" && env "${common[@]}" "$@" "$py" -m pip wheel --quiet --disable-pip-version-check \
      --no-build-isolation --no-deps -w "$work/wheel" . >"$work/build.log" 2>&1)
  }
  flags=()
  [ "$torch_v" != none ] && flags+=(HOROVOD_WITH_PYTORCH=1) || flags+=(HOROVOD_WITHOUT_PYTORCH=1)
  [ "$tf_v" != none ] && flags+=(HOROVOD_WITH_TENSORFLOW=1) || flags+=(HOROVOD_WITHOUT_TENSORFLOW=1)
  if ! build "${flags[@]}"; then
    tail -20 "$work/build.log" >&2
    if [ "$torch_v" != none ] && build HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1; then
      echo "build_horovod.sh: WARNING: Horovod built for torch only; its TensorFlow part failed to build" >&2
    elif [ "$tf_v" != none ] && build HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1; then
      echo "build_horovod.sh: WARNING: Horovod built for TensorFlow only; its torch part failed to build" >&2
    else
      tail -40 "$work/build.log" >&2
      echo "build_horovod.sh: Horovod $hvd_version failed to build; log above" >&2
      exit 1
    fi
  fi
  mkdir -p "$cache"
  rm -rf "$cache/$key.tmp" && mkdir "$cache/$key.tmp"
  cp "$work"/wheel/horovod-*.whl "$cache/$key.tmp/"
  rm -rf "$cache/$key" && mv "$cache/$key.tmp" "$cache/$key"  # appears whole or not at all
fi
"${pip[@]}" --force-reinstall --no-deps "$cache/$key"/horovod-*.whl
"${pip[@]}" cloudpickle psutil pyyaml packaging
touch "$venv/.unifit-$key"
