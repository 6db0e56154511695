import pytest

from tests.pool import close_all


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    close_all()
