"""The fleet's databases file: what a good file gives, which mistakes fail the whole file (with
what to fix) and which only the one database, secrets kept out of every message, and a file
edited or broken between two reads of a fleet's `Sources`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from outbox_farm.errors import ConfigurationError
from outbox_farm.fleet.databases import DEFAULT, FILE, NAME, Listing, Sources, read_file

URL = "postgresql://app@db.internal:5432/tenant_1"
CONNINFO = "host=db.internal port=5432 dbname=tenant_2 user=app"
HOME = "host=home.internal dbname=home"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def read(sources: Sources) -> Listing:
    return asyncio.run(asyncio.wait_for(sources.read(), 30))


def test_a_good_file_gives_every_database_in_either_dsn_form(tmp_path: Path) -> None:
    path = write(
        tmp_path / "set.toml",
        f'# the tenants\n[databases]\ntenant_1 = "{URL}"\n"tenant-2.eu" = "{CONNINFO}"\n',
    )

    listing = read_file(path)

    assert listing == Listing({"tenant_1": URL, "tenant-2.eu": CONNINFO}, {})


def test_an_empty_table_is_an_empty_set_not_an_error(tmp_path: Path) -> None:
    assert read_file(write(tmp_path / "set.toml", "[databases]\n")) == Listing({}, {})


def test_variables_are_expanded_from_the_environment_when_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(
        tmp_path / "set.toml",
        "[databases]\n"
        'a = "host=db dbname=a password=${TENANT_A_PASSWORD}"\n'
        'b = "postgresql://app:${TENANT_B_PASSWORD}@db/b"\n'
        'c = "host=db dbname=c password=$${KEPT}"\n',
    )
    monkeypatch.setenv("TENANT_A_PASSWORD", "first-secret")
    monkeypatch.setenv("TENANT_B_PASSWORD", "second-secret")

    first = read_file(path)
    monkeypatch.setenv("TENANT_A_PASSWORD", "rotated-secret")
    second = read_file(path)

    assert first.databases == {
        "a": "host=db dbname=a password=first-secret",
        "b": "postgresql://app:second-secret@db/b",
        "c": "host=db dbname=c password=${KEPT}",
    }
    assert first.problems == {}
    assert second.databases["a"] == "host=db dbname=a password=rotated-secret"


def test_an_unset_variable_is_a_problem_of_that_database_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TENANT_7_PASSWORD", raising=False)
    monkeypatch.delenv("TENANT_7_HOST", raising=False)
    path = write(
        tmp_path / "set.toml",
        "[databases]\n"
        f'good = "{CONNINFO}"\n'
        'tenant_7 = "host=${TENANT_7_HOST} password=${TENANT_7_PASSWORD}"\n',
    )

    listing = read_file(path)

    assert listing.databases == {"good": CONNINFO}
    assert listing.problems == {
        "tenant_7": "environment variables TENANT_7_HOST, TENANT_7_PASSWORD are not set"
    }


def test_a_dsn_libpq_cannot_parse_is_a_problem_without_its_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # libpq quotes the token it cannot decode: here the password, from the environment.
    monkeypatch.setenv("TENANT_PASSWORD", "s3cret%zzvalue")
    path = write(
        tmp_path / "set.toml",
        "[databases]\n"
        f'good = "{URL}"\n'
        'encoded = "postgresql://app:${TENANT_PASSWORD}@db/x"\n'
        'quoted = "host=db password=\'in-file-secret"\n',
    )

    listing = read_file(path)

    assert listing.databases == {"good": URL}
    assert set(listing.problems) == {"encoded", "quoted"}
    for problem in listing.problems.values():
        assert problem.startswith("the DSN in the file cannot be parsed: ")
        assert "\n" not in problem
        assert "s3cret" not in problem
        assert "zzvalue" not in problem
        assert "in-file-secret" not in problem
    assert "percent-encoded" in listing.problems["encoded"]
    assert "unterminated" in listing.problems["quoted"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[databases]\n"has space" = "host=db"\n', "name 'has space' is not 1 to 63 of"),
        ('[databases]\n_hidden = "host=db"\n', "name '_hidden' is not 1 to 63 of"),
        (f'[databases]\n{"x" * 64} = "host=db"\n', f"name '{'x' * 64}' is not"),
        ("[databases]\nport = 5432\n", "port must be a DSN string (a URL or key=value text), "),
        ('[databases.eu]\nhost = "db"\n', "eu must be a DSN string (a URL or key=value text), "),
        ('[databases]\nx = ["host=db"]\n', "x must be a DSN string"),
    ],
)
def test_an_entry_that_is_not_a_name_and_a_string_fails_the_file(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = write(tmp_path / "set.toml", text)

    with pytest.raises(ConfigurationError) as caught:
        read_file(path)

    assert str(caught.value).startswith(f"databases file {path}: ")
    assert expected in str(caught.value)


def test_every_bad_entry_is_named_at_once_so_one_edit_fixes_them_all(tmp_path: Path) -> None:
    path = write(tmp_path / "set.toml", '[databases]\nok = "host=db"\n"a b" = "x"\nn = 1\n')

    with pytest.raises(ConfigurationError, match=r"name 'a b' is not .*; n must be a DSN string"):
        read_file(path)


def test_a_toml_syntax_error_says_where(tmp_path: Path) -> None:
    path = write(tmp_path / "set.toml", '[databases]\ngood = "host=db"\nbroken = "host=db\n')

    with pytest.raises(ConfigurationError) as caught:
        read_file(path)

    message = str(caught.value)
    assert message.startswith(f"databases file {path} is not valid TOML: ")
    assert "line 3" in message


def test_a_missing_file_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "set.toml"

    with pytest.raises(ConfigurationError, match="does not exist: fix the path") as caught:
        read_file(path)

    assert str(path) in str(caught.value)


def test_a_directory_is_not_a_file_to_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as caught:
        read_file(tmp_path)

    assert str(caught.value).startswith(f"cannot read databases file {tmp_path}: Is a directory")


def test_a_file_without_the_table_says_how_to_write_it(tmp_path: Path) -> None:
    path = write(tmp_path / "set.toml", '[database]\ntenant_1 = "host=db"\n')

    with pytest.raises(ConfigurationError, match=r"has no \[databases\] table: write"):
        read_file(path)


def test_a_name_is_what_a_metric_label_and_an_argument_can_hold() -> None:
    good = ["a", "7", "tenant_7", "eu-west.tenant-7", "T" * 63]
    bad = ["", "-a", ".a", "_a", "a b", "a/b", "a:b", "é", "T" * 64]

    assert [name for name in good if NAME.fullmatch(name)] == good
    assert [name for name in bad if NAME.fullmatch(name)] == []


def test_without_file_or_catalog_the_home_database_is_the_set() -> None:
    assert read(Sources(None, None, HOME)) == Listing({DEFAULT: HOME}, {})


def test_an_edited_file_is_read_again(tmp_path: Path) -> None:
    path = write(tmp_path / "set.toml", f'[databases]\na = "{URL}"\n')
    sources = Sources(path, None, HOME)

    first = read(sources)
    write(path, f'[databases]\nb = "{CONNINFO}"\nc = "{URL}"\n')
    second = read(sources)

    assert first == Listing({"a": URL}, {})
    assert second == Listing({"b": CONNINFO, "c": URL}, {})


def test_a_broken_file_keeps_the_last_good_set_until_fixed(tmp_path: Path) -> None:
    path = write(tmp_path / "set.toml", f'[databases]\na = "{URL}"\nb = "{CONNINFO}"\n')
    sources = Sources(path, None, HOME)
    good = read(sources)

    write(path, f'[databases]\na = "{URL}"\nb = "host=')  # saved half-written
    broken = read(sources)
    path.unlink()
    gone = read(sources)
    write(path, f'[databases]\nb = "{CONNINFO}"\n')
    fixed = read(sources)

    assert good == Listing({"a": URL, "b": CONNINFO}, {})
    assert broken.databases == good.databases
    assert list(broken.problems) == [FILE]
    assert "is not valid TOML" in broken.problems[FILE]
    assert "Unterminated string (at end of document)" in broken.problems[FILE]
    assert broken.problems[FILE].endswith("(its last good list, 2 databases, kept)")
    assert gone.databases == good.databases
    assert "does not exist" in gone.problems[FILE]
    assert fixed == Listing({"b": CONNINFO}, {})


def test_a_file_broken_from_the_first_read_gives_nothing_and_says_why(tmp_path: Path) -> None:
    path = write(tmp_path / "set.toml", "databases = 1\n")
    sources = Sources(path, None, HOME)

    listing = read(sources)

    assert listing.databases == {}
    assert listing.problems[FILE].startswith(f"databases file {path} has no [databases] table")
    assert listing.problems[FILE].endswith("(nothing read from it yet)")


def test_a_problem_of_one_database_is_kept_beside_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MISSING_PASSWORD", raising=False)
    path = write(
        tmp_path / "set.toml",
        f'[databases]\na = "{URL}"\nb = "host=db password=${{MISSING_PASSWORD}}"\n',
    )

    listing = read(Sources(path, None, HOME))

    assert listing == Listing({"a": URL}, {"b": "environment variable MISSING_PASSWORD is not set"})
