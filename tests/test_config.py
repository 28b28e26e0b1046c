"""Config loading: TOML -> environment -> flags, validated with file and key in errors."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from cached.config import _ALIASES, _SECTIONS, format_size, load, parse_size
from cached.errors import ConfigError


def test_sizes_parse_from_human_strings() -> None:
    assert parse_size("500GiB") == 500 * 1024**3
    assert parse_size("64MB") == 64 * 1000**2
    assert parse_size("1.5KiB") == 1536
    assert parse_size(4096) == 4096
    assert format_size(1536) == "1.5 KiB"
    for bad in ("lots", "10XB", "-1", "1 2"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


EXAMPLE = Path(__file__).parent.parent / "config.example.toml"


def example_keys(text: str) -> dict[str, set[str]]:
    """The keys the example lists per section: set (``key = ...``), or shown commented out
    (``# key = ...``, for keys whose default is unset)."""
    listed: dict[str, set[str]] = {}
    section = None
    for line in text.splitlines():
        if m := re.fullmatch(r"\[(\w+)\]", line.strip()):
            section = m[1]
            listed[section] = set()
        elif section and (m := re.match(r"#? ?(\w+) = ", line)):
            listed[section].add(m[1])
    return listed


def test_example_config_lists_every_key_and_matches_defaults() -> None:
    """The example says "every key is listed, set to its built-in default": a key missing
    from it would load as its default all the same, so the keys are counted, not only
    the values compared."""
    example = load(EXAMPLE, env={})
    defaults = load(None, env={})
    assert example.server == defaults.server
    assert example.cache == defaults.cache
    assert example.s3 == defaults.s3
    assert example.prefetch == defaults.prefetch
    assert example.cold == defaults.cold
    text = EXAMPLE.read_text()
    listed = example_keys(text)
    set_keys = {section: set(keys) for section, keys in tomllib.loads(text).items()}
    names = {field: key for key, field in _ALIASES.items()}
    for section, cls in _SECTIONS.items():
        keys = {names.get(f.name, f.name) for f in dataclasses.fields(cls)}
        assert listed.get(section) == keys, (section, keys ^ listed.get(section, set()))
        # What is set is a real key (the rest is listed only as a comment).
        assert set_keys[section] <= keys, section


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[cache]\ndir = "/a"\ncapacity = "10GiB"\n[s3]\nendpoint_url = "http://x:9000"\n'
    )
    cfg = load(
        path,
        env={"CACHED_CACHE_CAPACITY": "20GiB", "CACHED_S3_REGION": "eu-west-1"},
        overrides={"cache.dir": "/b"},
    )
    assert cfg.cache.capacity_bytes == 20 * 1024**3
    assert cfg.cache.dir == Path("/b")
    assert cfg.s3.endpoint_url == "http://x:9000"
    assert cfg.s3.region == "eu-west-1"
    assert cfg.source == str(path)


def test_config_path_from_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[prefetch]\nlookahead = "1GiB"\n')
    assert load(None, env={"CACHED_CONFIG": str(path)}).prefetch.lookahead_bytes == 1024**3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cache]\ncapacityy = 1\n", r"unknown key \[cache\] 'capacityy'"),
        ("[cachee]\n", r"unknown section \[cachee\]"),
        ('[cache]\ncapacity = "huge"\n', r"\[cache\] capacity: not a size"),
        ('[s3]\nretry_attempts = "many"\n', "retry_attempts: not an integer"),
        ("[s3]\nverify_checksum = 1\n", "not a boolean"),
        ('[cache]\npolicy = "random"\n', "policy must be one of"),
        ('[server]\nsocket = "udp://x"\n', "socket must start with"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_bad_files_fail_naming_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load(path, env={})
    assert str(path) in str(info.value)


def test_bad_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="environment CACHED_CACHE_CAPACITY"):
        load(None, env={"CACHED_CACHE_CAPACITY": "lots"})
    with pytest.raises(ConfigError, match="unknown key"):
        load(None, env={"CACHED_CACHE_COLOUR": "blue"})


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "nope.toml", env={})
