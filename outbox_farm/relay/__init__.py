"""Relays: outbox rows published to a broker in confirmed batches (see `base` for the contract)."""
