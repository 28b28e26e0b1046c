"""Config loading: TOML -> environment -> flags, validated with file and key in errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from cached.config import format_size, load, parse_size
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


def test_example_config_loads_and_matches_defaults() -> None:
    example = load(Path(__file__).parent.parent / "config.example.toml", env={})
    defaults = load(None, env={})
    assert example.server == defaults.server
    assert example.cache == defaults.cache
    assert example.s3 == defaults.s3
    assert example.prefetch == defaults.prefetch


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
