"""The app of the example image: `outbox-farm start app:farm` imports `farm` from /app (and
`app:fleet`, the same farm in many databases).

An order service publishes to the `orders` queue in the transaction that changes an order; the
handler then drops that order's cached copy from Redis, so no reader sees the old one once the
change committed. A Redis outage is an ordinary handler error: the row is retried later.
"""

from __future__ import annotations

import os

import redis.asyncio as redis

from outbox_farm import ExponentialBackoff, Farm, Message
from outbox_farm.fleet import Fleet

farm = Farm()
# The client of this worker process, made at its first message: one made at import would be
# made in the arbiter, and its connections shared by every worker forked from it.
_cache: redis.Redis | None = None


def cache() -> redis.Redis:
    global _cache
    if _cache is None:
        _cache = redis.Redis.from_url(os.environ.get("ORDERS_CACHE_URL", "redis://redis:6379/0"))
    return _cache


@farm.handler("orders", retry=ExponentialBackoff(first=1.0, factor=2.0, cap=60.0, jitter=0.2))
async def forget_cached_order(msg: Message) -> None:
    await cache().delete(f"order:{msg.json()['order_id']}")


# The same farm in every tenant database of a set (`outbox-farm start app:fleet`, as the
# Kubernetes component deploy/kubernetes/components/fleet runs it): the set is the file that
# component mounts, and the fleet's leases live in the database of --dsn.
fleet = Fleet(farm, databases="/etc/outbox-farm/fleet/databases.toml")
