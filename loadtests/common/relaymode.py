"""The load test's relay mode, the broker's side: which queues may be loaded, and the consumer
process (`relay_consumer.py`) that records what reached RabbitMQ or Kafka.

`load/run_loadtest.py --relay rabbitmq|kafka` starts the consumer before the farm (`relayapp.py`),
stops it after the drain (it empties its queue first), and reads its summary. With `--relay
kafka` and no `--kafka`, a tansu broker (`kafkabroker.py`) serves the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtests.common import scenario
from loadtests.common.harness import SetupError
from loadtests.common.kafkabroker import kafka_servers
from outbox_farm.dsn import redact_url

HERE = Path(__file__).resolve().parent
RELAY_WEIGHTS = "ok=90,poison=10"  # relayapp's queues: delivered, and unroutable


def check_relayed(weights: dict[str, float]) -> None:
    """Relay mode publishes only to the queues relayapp relays; others would never drain."""
    relayed = (*scenario.RELAYED, *scenario.UNROUTABLE)
    stray = [q for q, w in weights.items() if w > 0 and q not in relayed]
    if stray:
        raise ValueError(
            f"--relay relays only {', '.join(relayed)}; give the others weight 0 (not "
            f"{', '.join(stray)})"
        )


@dataclass
class Consumer:
    """The relay consumer's process; `summary` is filled when it has stopped."""

    proc: subprocess.Popen[str]
    exchange: str  # RabbitMQ's exchange, or the prefix of the Kafka topics
    env: dict[str, str]  # what the farm's relayapp needs to publish where this consumer reads
    where: str = ""  # the broker, for messages
    summary: dict[str, int] | None = None
    stopped: bool = False

    def stop(self) -> None:
        """SIGTERM: it empties its queue (at most a minute), then prints its summary."""
        if self.stopped:
            return
        self.stopped = True
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        if self.proc.returncode == 0 and lines:
            self.summary = json.loads(lines[-1])


@contextlib.contextmanager
def relay_consumer(args: argparse.Namespace, dsn: str, work: Path) -> Iterator[Consumer]:
    """Make the destination (an exchange and a bound queue, or the topics), start consuming;
    stop and clean up after."""
    name = f"loadtest_relay_{uuid.uuid4().hex[:10]}"
    with contextlib.ExitStack() as stack:
        if args.relay == "kafka":
            servers = stack.enter_context(kafka_servers(args.kafka))
            where = f"Kafka {servers}"
            hint = "is Kafka running? set --kafka or LOADTEST_KAFKA, or neither for a tansu broker"
            command = ["--kafka", servers]
            env = {"LOADTEST_RELAY": "kafka", "LOADTEST_KAFKA": servers}
        else:
            where = f"RabbitMQ {redact_url(args.amqp)}"
            hint = "is RabbitMQ running? set --amqp or LOADTEST_AMQP"
            command = ["--amqp", args.amqp, "--queue", name]
            env = {"LOADTEST_RELAY": "rabbitmq", "LOADTEST_AMQP": args.amqp}
        command = [sys.executable, str(HERE / "relay_consumer.py"), *command]
        command += ["--exchange", name, "--dsn", dsn]
        for queue in scenario.RELAYED:
            command += ["--bind", queue]
        with (work / "consumer.log").open("w") as log:
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        consumer = Consumer(proc, name, {**env, "LOADTEST_EXCHANGE": name}, where=where)
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline().strip()  # "ready" once bound; EOF when it failed
            if first != "ready":
                proc.wait(timeout=30)
                tail = (work / "consumer.log").read_text(errors="replace")[-1500:]
                raise SetupError(f"the relay consumer could not start on {where} ({hint}):\n{tail}")
            yield consumer
        finally:
            consumer.stop()
