"""Make tests.e2e.fake_runs importable however pytest was started (the repository root on sys.path)."""

import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from zeropipe.server.app import create_app
from zeropipe.store import Roots, RunStore

ROOT = str(Path(__file__).resolve().parents[3])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# A store over empty runs/ and data/ folders, and a client of the app on it (test files may define their own).
@pytest.fixture
def store(tmp_path):
    (tmp_path / "data").mkdir()
    store = RunStore(Roots(runs=[tmp_path / "runs"], data=[tmp_path / "data"], base=tmp_path))
    yield store
    store.close()


@pytest.fixture
def client(store):
    with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
        yield client
