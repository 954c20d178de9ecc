import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "workers"))
# Tests import mxnet as a plain library: make sure no DMLC_ROLE leaks in (with DMLC_ROLE=server/scheduler the import
# would start a stock node).
for name in [k for k in os.environ if k.startswith("DMLC_")]:
    del os.environ[name]


@pytest.fixture
def job_factory(tmp_path):
    """Make Job objects that are always torn down (every process ended by PID)."""
    from cluster import Job

    jobs = []

    def make(name: str, **kwargs) -> Job:
        d = tmp_path / name
        d.mkdir()
        job = Job(d, **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill()
