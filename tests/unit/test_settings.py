"""`RuntimeSettings` and `SupervisorSettings` refuse every bad value when they are made, with a
ConfigurationError naming the option, before any process or connection starts."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from outbox_farm.errors import ConfigurationError
from outbox_farm.settings import RuntimeSettings, SupervisorSettings

NOT_SECONDS = [-1, float("nan"), float("inf"), "1", True, None]


def refused(kind: type[Any], option: str, value: object) -> None:
    with pytest.raises(ConfigurationError) as caught:
        kind(**{option: value})
    assert option in str(caught.value)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        *[("poll_interval", bad) for bad in [*NOT_SECONDS, 0]],
        *[("flush_interval", bad) for bad in NOT_SECONDS],
        *[("graceful_timeout", bad) for bad in NOT_SECONDS],
        *[
            (chore, bad)
            for chore in ("gauges_interval", "vacuum_interval", "dlq_retention")
            for bad in (-1, float("nan"), "10")
        ],
        *[("flush_size", bad) for bad in (0, -5, 1.5, True, "100")],
        *[("queues", bad) for bad in ("orders", 7, ["orders", ""], ["orders", 7])],
        *[("listen", bad) for bad in (1, "yes", None)],
        *[("worker_id", bad) for bad in (-1, 2**31, 1.5, True, "7")],
    ],
)
def test_runtime_settings_refuse_a_bad_value(option: str, value: object) -> None:
    refused(RuntimeSettings, option, value)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        *[("procs", bad) for bad in (0, -1, 1.5, True, "2")],
        *[("graceful_timeout", bad) for bad in NOT_SECONDS],
        *[("heartbeat_timeout", bad) for bad in [*NOT_SECONDS, 0, 0.5]],
        *[("metrics_bind", bad) for bad in ("", "9464", "localhost", "h:65536", "::1:80", 9464)],
        *[("preload", bad) for bad in (1, "yes", None)],
        *[("reload", bad) for bad in (0, "no", None)],
        ("runtime", None),
        ("runtime", {"poll_interval": 1.0}),
    ],
)
def test_supervisor_settings_refuse_a_bad_value(option: str, value: object) -> None:
    refused(SupervisorSettings, option, value)


def test_defaults_are_valid() -> None:
    settings = SupervisorSettings()
    assert settings.procs == 1
    assert settings.metrics_bind == "127.0.0.1:9464"
    assert settings.runtime == RuntimeSettings()


@pytest.mark.parametrize("bind", [None, ":0", "[::1]:9464", "0.0.0.0:80"])
def test_metrics_bind_takes_host_port_or_none(bind: str | None) -> None:
    assert SupervisorSettings(metrics_bind=bind).metrics_bind == bind


def test_the_workers_drain_within_the_supervisors_graceful_timeout() -> None:
    settings = SupervisorSettings(graceful_timeout=5.0, runtime=RuntimeSettings(poll_interval=2))
    assert settings.runtime.graceful_timeout == 5.0
    assert settings.runtime.poll_interval == 2


def test_settings_are_frozen() -> None:
    settings = SupervisorSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.procs = 2  # type: ignore[misc]


def test_queues_become_a_tuple() -> None:
    assert RuntimeSettings(queues=["a", "b"]).queues == ("a", "b")  # type: ignore[arg-type]


def test_only_the_housekeeper_keeps_the_table_wide_chores() -> None:
    template = RuntimeSettings(vacuum_interval=10.0, dlq_retention=3600.0)
    keeper = template.for_worker(7, housekeeper=True, gauges_interval=5.0)
    other = template.for_worker(8, housekeeper=False, gauges_interval=5.0)
    assert (keeper.worker_id, keeper.gauges_interval, keeper.vacuum_interval) == (7, 5.0, 10.0)
    assert keeper.dlq_retention == 3600.0
    assert (other.worker_id, other.gauges_interval, other.vacuum_interval) == (8, None, None)
    assert other.dlq_retention is None
