"""GPU-only tests. ``tests/gpu/run.sh`` runs them with ``--confcutdir=tests/gpu`` (the parent
conftest needs the daemon's gRPC extras, which a bare GPU image may lack), so the shared test
helpers in ``tests/`` are put on the path here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
