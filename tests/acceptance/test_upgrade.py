"""Upgrades in either order (DESIGN.md §9, invariant 18), with real processes under load.

The previous release is built as a wheel from this repository's history (the commit that
released it, found by its changelog heading) and installed into a folder of its own; its
processes run with that folder first on the import path, this release's without it. Each
test migrates with the previous release, runs its farm and a producer, switches code and schema
in one order while producers keep publishing, drains, and checks that every committed row was
delivered and no publish failed.

The history must be there: a clean clone has it. Without it the tests skip on a developer's
machine and fail in CI (`CI` set): an upgrade test that quietly stops running proves nothing.
`UPGRADE_TEST_HISTORY` names another git checkout of the project to read it from (CI runs the
tests in a copy of the tree without `.git`).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.steps import wait_for

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS = "0.1.0"  # the release before this one, as CHANGELOG.md heads its section
LOAD = Path(__file__).with_name("upgrade_load.py")
BOOT = 60.0  # seconds a farm or producer may take to show progress on a busy machine

pytestmark = [pytest.mark.slow, pytest.mark.one_server]

APP = """\
import os

from outbox_farm import Farm, Message

farm = Farm("outbox", "outbox_dlq")
_out = os.open(os.environ["UPGRADE_DELIVERED"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)


@farm.handler("up", concurrency=16)
async def up(msg: Message) -> None:
    os.write(_out, b"%d\\n" % msg.json()["n"])
"""


def _git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=True).stdout


def _release_commit(repo: Path) -> str | None:
    """The commit that added the previous release's changelog heading; None without history."""
    try:
        found = _git(repo, "log", "--format=%H", f"-S## [{PREVIOUS}] - ", "--", "CHANGELOG.md")
    except (OSError, subprocess.CalledProcessError):
        return None
    commits = found.decode().split()
    return commits[-1] if commits else None


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the previous release, installed from its wheel: put it first on
    PYTHONPATH to run that release."""
    repo = Path(os.environ.get("UPGRADE_TEST_HISTORY", ROOT))
    commit = _release_commit(repo)
    if commit is None:
        reason = (
            f"release {PREVIOUS} not found in the git history of {repo}: run the upgrade test "
            "in a full clone, or set UPGRADE_TEST_HISTORY to one"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("previous")
    with tarfile.open(fileobj=io.BytesIO(_git(repo, "archive", commit))) as archive:
        archive.extractall(folder / "src", filter="data")
    pip = [sys.executable, "-m", "pip", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", folder / "wheel", folder / "src"], check=True)
    (wheel,) = (folder / "wheel").glob("outbox_farm-*.whl")
    site = folder / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", site, wheel], check=True
    )
    return site


@dataclass
class Upgrade:
    """One upgrade's folder, database and processes; `old` and `new` are their environments."""

    folder: Path
    dsn: str
    old: dict[str, str]
    new: dict[str, str]
    procs: list[subprocess.Popen[bytes]]

    def cli(self, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "outbox_farm.cli", *args, "--dsn", self.dsn]
        return subprocess.run(
            command, cwd=self.folder, env=env, capture_output=True, text=True, timeout=BOOT
        )

    def spawn(self, name: str, env: dict[str, str], command: list[str]) -> subprocess.Popen[bytes]:
        with (self.folder / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                command, cwd=self.folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def farm(self, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        metrics = ["--metrics-bind", "127.0.0.1:0", "--metrics-dir", str(self.folder / name)]
        command = [sys.executable, "-m", "outbox_farm.cli", "start", "app:farm", "--procs", "1"]
        return self.spawn(name, env, [*command, "--dsn", self.dsn, *metrics])

    def load(self, name: str, env: dict[str, str], first: int) -> subprocess.Popen[bytes]:
        record, stop = self.folder / f"{name}.published", self.folder / f"{name}.stop"
        record.touch()
        command = [sys.executable, str(LOAD), self.dsn, str(first), str(record), str(stop)]
        return self.spawn(name, env, command)

    def numbers(self, name: str) -> list[int]:
        return [int(line) for line in (self.folder / name).read_text().split()]

    def published_more(self, name: str) -> Callable[[], bool]:
        """A condition: producer `name` commits again after this call."""
        before = len(self.numbers(f"{name}.published"))
        return lambda: len(self.numbers(f"{name}.published")) > before

    def stop_load(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        (self.folder / f"{name}.stop").touch()
        assert proc.wait(timeout=BOOT) == 0, self.log(name)  # 0: no publish failed

    def stop_farm(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=BOOT) == 0, self.log(name)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def outbox_rows(self) -> int:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute("SELECT count(*) FROM outbox").fetchone()
        assert row is not None
        return int(row[0])

    def drained_all(self, farm: str, proc: subprocess.Popen[bytes]) -> None:
        """Wait for an empty outbox with `farm` running, stop it, and check every committed
        number was delivered."""
        wait_for(lambda: proc.poll() is None and self.outbox_rows() == 0, f"{farm} drains", BOOT)
        self.stop_farm(farm, proc)
        published = set(self.numbers("old.published")) | set(self.numbers("new.published"))
        assert published, "nothing was published"
        missing = published - set(self.numbers("delivered"))
        assert not missing, f"{len(missing)} committed rows never delivered"


@pytest.fixture
def upgrade(previous_release: Path, empty_dsn: str, tmp_path: Path) -> Iterator[Upgrade]:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "delivered").touch()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_FARM_", "PYTHON"))}
    base |= {"TMPDIR": str(tmp_path), "UPGRADE_DELIVERED": str(tmp_path / "delivered")}
    old = base | {"PYTHONPATH": f"{previous_release}{os.pathsep}{tmp_path}"}
    new = base | {"PYTHONPATH": str(tmp_path)}
    up = Upgrade(tmp_path, empty_dsn, old, new, [])
    try:
        yield up
    finally:
        for proc in up.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _versions(up: Upgrade) -> None:
    """The two environments run two different releases: the old one from its wheel."""
    probe = "import outbox_farm; print(outbox_farm.__file__)"
    for env, inside in ((up.old, True), (up.new, False)):
        where = subprocess.run(
            [sys.executable, "-c", probe], env=env, cwd=up.folder, capture_output=True, text=True
        ).stdout
        assert ("previous" in where) is inside, where


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_code_first_then_schema_under_load(upgrade: Upgrade) -> None:
    up = upgrade
    _versions(up)
    assert up.cli(up.old, "migrate").returncode == 0
    old_farm = up.farm("old-farm", up.old)
    old_load = up.load("old", up.old, 0)
    wait_for(up.published_more("old"), "the previous release's producer", BOOT)
    wait_for(lambda: up.numbers("delivered"), "the previous release's farm", BOOT)

    # The new code first: its producer publishes into the older schema, none failing.
    new_load = up.load("new", up.new, 10**8)
    wait_for(up.published_more("new"), "this release's producer on the previous schema", BOOT)
    up.stop_load("old", old_load)
    # Its farm refuses the older schema, in one line saying what to run.
    refused = up.cli(up.new, "start", "app:farm", "--procs", "1")
    assert refused.returncode != 0
    assert "run `outbox-farm migrate`" in refused.stderr.strip().splitlines()[-1]

    # Then the schema, under load; then the new farm takes over from the old one.
    assert up.cli(up.new, "migrate").returncode == 0
    wait_for(up.published_more("new"), "this release's producer after the migration", BOOT)
    new_farm = up.farm("new-farm", up.new)
    up.stop_farm("old-farm", old_farm)
    wait_for(up.published_more("new"), "this release's producer with its farm", BOOT)
    up.stop_load("new", new_load)
    up.drained_all("new-farm", new_farm)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_schema_first_then_code_under_load(upgrade: Upgrade) -> None:
    up = upgrade
    assert up.cli(up.old, "migrate").returncode == 0
    old_farm = up.farm("old-farm", up.old)
    old_load = up.load("old", up.old, 0)
    wait_for(up.published_more("old"), "the previous release's producer", BOOT)

    # The schema first: the previous release's farm and producer keep working on it.
    assert up.cli(up.new, "migrate").returncode == 0
    wait_for(up.published_more("old"), "the previous release's producer after the migration", BOOT)
    seen = len(up.numbers("delivered"))
    wait_for(
        lambda: len(up.numbers("delivered")) > seen, "the previous farm after the migration", BOOT
    )

    # Then the code: the new producer and farm take over.
    new_load = up.load("new", up.new, 10**8)
    wait_for(up.published_more("new"), "this release's producer", BOOT)
    up.stop_load("old", old_load)
    new_farm = up.farm("new-farm", up.new)
    up.stop_farm("old-farm", old_farm)
    wait_for(up.published_more("new"), "this release's producer with its farm", BOOT)
    up.stop_load("new", new_load)
    up.drained_all("new-farm", new_farm)
