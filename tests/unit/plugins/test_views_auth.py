"""Who may read the report and registry views is Airflow's auth manager's decision, asked for the DAG each
request reads: a user restricted to another DAG gets a 403, whatever the query says.

In process: the views' FastAPI apps behind a real auth manager (Airflow's SimpleAuthManager, with one user
limited to one DAG, as a deployment's FAB or Keycloak manager would limit one), JWTs that manager signed,
and the migrated Airflow DB that the access check reads.
"""

import pytest
from fastapi.testclient import TestClient

pytest.importorskip("airflow")

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager  # noqa: E402
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser  # noqa: E402

RESTRICTED, ITS_DAG = "restricted", "other_dag"


class OneDagAuthManager(SimpleAuthManager):
    """SimpleAuthManager, but the user `restricted` may read the DAG `other_dag` only."""

    def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
        if user.get_name() == RESTRICTED:
            return method == "GET" and details is not None and details.id == ITS_DAG
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)


@pytest.fixture
def tokens(airflow_db, s3_server, monkeypatch):
    from airflow.api_fastapi.app import init_auth_manager, purge_cached_app

    from tools.stack.config import conn_s3

    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER", f"{__name__}.OneDagAuthManager")
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "test-views-auth-" * 4)  # 64 bytes: HS512 wants no less
    monkeypatch.setenv("AIRFLOW_CONN_RLHF_S3", conn_s3(s3_server.endpoint))
    purge_cached_app()
    manager = init_auth_manager()
    assert isinstance(manager, OneDagAuthManager)
    yield {
        name: manager.generate_jwt(SimpleAuthManagerUser(username=name, role="viewer"))
        for name in ("viewer", RESTRICTED)
    }
    purge_cached_app()


@pytest.mark.parametrize(
    "view, path",
    [
        ("reports", "/"),  # the default DAG, rlhf_pipeline
        ("reports", "/?dag_id=rlhf_pipeline"),
        ("reports", "/dags/rlhf_pipeline/runs/manual__x/report.json"),
        ("registry_view", "/api"),  # the rlhf_registry DAG's
        ("registry_view", f"/api?dag_id={ITS_DAG}"),  # a dag_id in the query changes nothing
    ],
)
def test_a_user_of_another_dag_is_refused_and_a_reader_is_not(view, path, tokens):
    import importlib

    client = TestClient(importlib.import_module(f"plugins.{view}").app)

    def status(who: str | None) -> int:
        return client.get(path, headers={"Authorization": f"Bearer {tokens[who]}"} if who else {}).status_code

    assert status(None) == 401
    assert status(RESTRICTED) == 403
    assert status("viewer") not in (401, 403)  # past the check: the view's own answer (a page, or a one-line 404)


def test_the_restricted_user_reads_its_own_dags_reports(tokens):
    from plugins import reports

    client = TestClient(reports.app)
    response = client.get(f"/?dag_id={ITS_DAG}", headers={"Authorization": f"Bearer {tokens[RESTRICTED]}"})
    assert response.status_code not in (401, 403), response.text
