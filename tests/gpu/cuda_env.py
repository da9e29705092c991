"""Why GPU tests skip here, in words a reader can act on."""

from __future__ import annotations

import pytest


def cuda_skip_reason() -> str:
    try:
        import torch
    except ImportError:
        return "no CUDA device: torch is not installed"
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, {build}); "
                "GPU tests run on a GPU machine through tests/gpu/run.sh")
    return ""


def daemon_skip_reason() -> str:
    """The daemon-backed tests need the daemon's own dependencies (gRPC health/reflection,
    protobuf and grpcio at least as new as the committed stubs); a bare GPU image may lack
    them. Everything else in tests/gpu imports only ``kvstore.tiers``."""
    try:
        import grpc_health.v1.health  # noqa: F401
        import grpc_reflection.v1alpha.reflection  # noqa: F401

        import kvstore.clients  # noqa: F401
        import kvstore.daemon.main  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: cannot start a daemon here
        return (f"cannot start a daemon here: {type(e).__name__}: {e} "
                "(install the package with its dependencies, or carry their wheels in .whl/)")
    return ""


SKIP_REASON = cuda_skip_reason()
requires_cuda = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON or "CUDA present")
