"""A farm with one handler, as the README's testing examples assume: `emails` sends a message
to the address in the body, and an address that cannot be one fails every attempt until the
retry strategy gives up and the row goes to the DLQ (`retry_terminal`)."""

from __future__ import annotations

from outbox_farm import ExponentialBackoff, Farm, Message

farm = Farm()
sent: list[str] = []  # what a real app would hand to its mail server


@farm.handler("emails", retry=ExponentialBackoff(first=1.0, factor=2.0, cap=60.0, max_attempts=5))
async def send_email(msg: Message) -> None:
    address = msg.json()["to"]
    if "@" not in address:
        raise ValueError(f"not an e-mail address: {address!r}")
    sent.append(address)
