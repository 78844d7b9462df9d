"""ParameterServerStrategy's cluster checks (TF's wording), made before any actor starts."""

from __future__ import annotations

from typing import Any

import pytest

import jaxdist as jd

pytest.importorskip("ray")

from jaxdist.experimental.parameter_server import strategy as ps_strategy


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise AssertionError("Ray was started before the cluster was checked")

    monkeypatch.setattr(ps_strategy, "ensure_ray", refuse)


def _resolver(spec: dict[str, Any], task_type: str | None = None) -> Any:
    return jd.cluster_resolver.SimpleClusterResolver(
        jd.cluster_resolver.ClusterSpec(spec), task_type=task_type, task_id=0, rpc_layer="ray"
    )


@pytest.mark.parametrize(
    ("spec", "task_type", "message"),
    [
        ({"worker": ["w"], "ps": ["p"], "trainer": ["t"]}, None, "Disallowed task type.*trainer"),
        ({"worker": ["w"], "ps": ["p"]}, "master", "Unrecognized task_type: 'master'"),
        ({"chief": ["a", "b"], "worker": ["w"], "ps": ["p"]}, None, "at most one 'chief'"),
        ({"chief": ["c"], "ps": ["p"]}, None, "at least one worker"),
        ({"chief": ["c"], "worker": ["w"]}, None, "at least one ps"),
    ],
)
def test_cluster_checks(spec: dict[str, Any], task_type: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        jd.experimental.ParameterServerStrategy(_resolver(spec, task_type))


def test_not_a_resolver() -> None:
    with pytest.raises(TypeError, match="ClusterResolver"):
        jd.experimental.ParameterServerStrategy({"worker": ["w"], "ps": ["p"]})


def test_lazy_names() -> None:
    from jaxdist.experimental.coordinator import ClusterCoordinator, PerWorkerValues

    assert jd.experimental.coordinator.ClusterCoordinator is ClusterCoordinator
    assert PerWorkerValues([1, 2]).values == (1, 2)
    with pytest.raises(ValueError, match="one value per worker"):
        PerWorkerValues([])


def test_current_worker_index_outside_a_closure() -> None:
    from jaxdist.experimental.parameter_server.coordinator_context import dispatch

    index = jd.coordinator.experimental_get_current_worker_index
    assert index is jd.experimental.coordinator.experimental_get_current_worker_index
    with pytest.raises(RuntimeError, match=r"experimental_get_current_worker_index\(\).*schedule"):
        index()
    with dispatch(2):  # what a worker does around each closure
        assert index() == 2
    with pytest.raises(RuntimeError, match="no worker closure"):
        index()
