"""Reading this process's own metrics in the in-process tests, one way for all of them."""

from __future__ import annotations

from prometheus_client import REGISTRY

from outbox_farm.metrics import metrics


def sample(name: str, **labels: str) -> float:
    """The current value of one metric sample of this process (0 when never touched)."""
    metrics()  # registers the collectors on first use
    return REGISTRY.get_sample_value(name, labels) or 0.0


def claims(queue: str) -> float:
    """Claim statements this process ran for `queue`, empty ones included (one per poll)."""
    return sample("outbox_farm_fetch_seconds_count", queue=queue)
