"""Make tests.e2e.fake_runs importable however pytest was started (the repository root on sys.path)."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[3])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
