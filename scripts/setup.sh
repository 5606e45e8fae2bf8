#!/usr/bin/env bash
# Install what a unifit job needs into .venv (override with UNIFIT_VENV). Safe to run again:
# an unchanged profile is detected by a stamp and costs nothing.
#   scripts/setup.sh main   # the example job: torch (CPU build) + scikit-learn
#   scripts/setup.sh test   # everything the test suite needs, Horovod included (built once, cached)
set -euo pipefail
profile="${1:-main}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${UNIFIT_VENV:-$repo/.venv}"
python="${UNIFIT_PYTHON:-$(command -v python3.11 || command -v python3)}"
# A bare 'torch' requirement can pull a multi-GB CUDA build; the pinned CPU build comes first.
torch_spec="${UNIFIT_TORCH_SPEC:-torch==2.13.0}"
# TensorFlow for the tests: the CPU build these machines were checked with, pinned like torch.
tf_spec="${UNIFIT_TF_SPEC:-tensorflow-cpu==2.21.0}"

case "$profile" in
  main) extras="torch,examples" ;;
  test) extras="all" ;;
  *) echo "setup.sh: unknown profile '$profile'; use 'main' or 'test'" >&2; exit 2 ;;
esac

# System tools the tests drive for real: tmux (a terminal for the progress bar), sshd (horovodrun
# reaching a second simulated host). Installed when missing and this is root with apt; else those tests
# skip with the command to run.
missing_tools() { ! command -v tmux >/dev/null || { ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ]; }; }
if [ "$profile" = test ] && missing_tools && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux openssh-server >/dev/null 2>&1 \
   || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux openssh-server >/dev/null 2>&1; }) \
   || echo "setup.sh: could not install tmux/openssh-server with apt; the tests that need them will skip" >&2
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
stamp="$venv/.unifit-$profile-$(cat "$repo/pyproject.toml" "$0" "$repo/scripts/build_horovod.sh" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "$torch_spec"
if [ "$profile" = test ]; then
  "$venv/bin/python" -c "import tensorflow" 2>/dev/null || "${pip[@]}" "$tf_spec"
fi
"${pip[@]}" -e "$repo[$extras]"
if [ "$profile" = test ]; then
  bash "$repo/scripts/build_horovod.sh" "$venv"  # from source, for this torch and TensorFlow
fi
touch "$stamp"
