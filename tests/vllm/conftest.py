"""The real-engine tests run only under ``make test-vllm`` (``KVMESH_TEST_VLLM=1``).

They need the CPU build of vLLM installed in its own venv (``tests/vllm/install_vllm.sh``, which the make target
runs) and take minutes, so a plain ``pytest`` or ``make test`` does not collect them. The ``vllm`` marker is
registered here for the same reason: the project's marker list stays that of the default suite.
"""

from __future__ import annotations

import os

import pytest

collect_ignore_glob = [] if os.environ.get("KVMESH_TEST_VLLM") == "1" else ["test_*.py"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: runs a real vLLM engine (make test-vllm)")
