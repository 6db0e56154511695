import pytest

from testkit.spawn import close_all


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    close_all()
