"""`python -m outbox_farm.cli`, the same as the `outbox-farm` script."""

from . import main

main(prog_name="outbox-farm")
