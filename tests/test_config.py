"""The run config (``run.toml``) and the CLI flags derived from config models."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from protocols.codec import pack
from protocols.errors import ConfigError
from protocols.keys import SigningKey
from swarm.cliargs import add_config_arguments, config_from_args
from swarm.components import check_components
from swarm.config import RunConfig

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-join-token"


@pytest.fixture(scope="module")
def peer_ids() -> list[str]:
    return [SigningKey.generate().peer_id for _ in range(3)]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


# RunConfig and its TOML form


def test_demo_config_round_trips_through_toml_exactly(tmp_path: Path) -> None:
    demo = RunConfig.demo()
    path = tmp_path / "run.toml"
    demo.to_toml(path)
    loaded = RunConfig.from_toml(path)
    assert loaded == demo
    assert loaded.model_dump() == demo.model_dump()


def test_full_config_round_trips_through_toml_exactly(tmp_path: Path, peer_ids: list[str]) -> None:
    config = RunConfig(
        run_id="my-run.v2",
        description='Ünïcode and "quotes"\nover two lines',
        coordinator_key=peer_ids[0],
        model={"name": "gpt", "config": {"d_model": 64, "n_head": 4, "n_layer": 2, "dropout": 0.0}},
        dataset={"name": "stdlib", "config": {"validation_fraction": 0.1, "max_bytes": 1 << 20}},
        admission={"policy": "token", "join_token": TOKEN, "allowlist": peer_ids[1:]},
        membership={"heartbeat_interval_s": 0.5, "offline_after_s": 1.5, "certificate_ttl_s": 60.0},
    )
    path = tmp_path / "run.toml"
    config.to_toml(path)
    assert RunConfig.from_toml(path) == config


def test_config_with_a_none_component_field_survives_toml(tmp_path: Path) -> None:
    # "max_bytes: None for all" is a documented, valid value of the stdlib dataset's config.
    from swarm.data import dataset_config

    config = RunConfig(run_id="r", dataset={"name": "stdlib", "config": {"max_bytes": None}})
    check_components(config)
    path = tmp_path / "run.toml"
    try:
        config.to_toml(path)
    except ConfigError as e:
        assert "max_bytes" in str(e)
    else:
        loaded = RunConfig.from_toml(path)
        assert dataset_config("stdlib", loaded.dataset.config) == dataset_config(
            "stdlib", config.dataset.config
        )


def test_unknown_admission_policy_names_the_field_and_the_allowed_values(tmp_path: Path) -> None:
    path = _write(tmp_path, 'run_id = "r"\n[admission]\npolicy = "closed"\n')
    with pytest.raises(ConfigError) as info:
        RunConfig.from_toml(path)
    message = str(info.value)
    assert str(path) in message
    assert "admission.policy" in message
    assert "'open', 'allowlist' or 'token'" in message
    assert "'closed'" in message


def test_invalid_toml_syntax_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, 'run_id = "r"\n[admission\n')
    with pytest.raises(ConfigError, match="is not valid TOML") as info:
        RunConfig.from_toml(path)
    assert str(path) in str(info.value)
    assert "line 2" in str(info.value)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('run_id = "r"\nrun_name = "typo"\n', "run_name"),
        ('run_id = "r"\n[membership]\nheartbeat_s = 1.0\n', "membership.heartbeat_s"),
        ('description = "no run id"\n', "run_id"),
        ('run_id = "has spaces"\n', "run_id"),
    ],
    ids=["unknown-top-level-key", "unknown-nested-key", "missing-run-id", "bad-run-id"],
)
def test_bad_field_is_named(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=f"{named}:"):
        RunConfig.from_toml(_write(tmp_path, text))


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "run.toml"
    with pytest.raises(ConfigError, match="cannot read run config") as info:
        RunConfig.from_toml(path)
    assert str(path) in str(info.value)


def test_to_spec_never_carries_admission_secrets(peer_ids: list[str]) -> None:
    config = RunConfig(
        run_id="r", admission={"policy": "allowlist", "allowlist": peer_ids[1:], "join_token": TOKEN}
    )
    spec = config.to_spec()
    encoded = pack(spec)
    assert TOKEN not in repr(spec) and TOKEN.encode() not in encoded
    for peer_id in peer_ids[1:]:
        assert peer_id not in repr(spec) and peer_id.encode() not in encoded
    assert "admission" not in spec
    assert spec["run_id"] == "r" and spec["model"]["name"] == "gpt"
    assert TOKEN not in repr(config)


def test_allowlist_entries_must_be_peer_ids(tmp_path: Path, peer_ids: list[str]) -> None:
    text = f'run_id = "r"\n[admission]\npolicy = "allowlist"\nallowlist = ["{peer_ids[0]}", "alice@example.org"]\n'
    with pytest.raises(ConfigError, match="admission.allowlist") as info:
        RunConfig.from_toml(_write(tmp_path, text))
    assert "alice@example.org" in str(info.value)


def test_coordinator_key_must_be_a_peer_id() -> None:
    with pytest.raises(ConfigError, match="coordinator_key"):
        RunConfig.parse({"run_id": "r", "coordinator_key": "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"})


@pytest.mark.parametrize(
    ("admission", "reason"),
    [({"policy": "allowlist"}, "non-empty allowlist"), ({"policy": "token"}, "needs join_token")],
)
def test_policy_needs_its_field(admission: dict, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        RunConfig.parse({"run_id": "r", "admission": admission})


def test_offline_after_must_exceed_two_heartbeat_intervals(tmp_path: Path) -> None:
    text = 'run_id = "r"\n[membership]\nheartbeat_interval_s = 5.0\noffline_after_s = 10.0\n'
    with pytest.raises(ConfigError, match="offline_after_s must exceed two heartbeat intervals"):
        RunConfig.from_toml(_write(tmp_path, text))
    ok = RunConfig.parse(
        {"run_id": "r", "membership": {"heartbeat_interval_s": 5.0, "offline_after_s": 10.5}}
    )
    assert ok.membership.offline_after_s == 10.5


def test_check_components_names_the_model_and_its_fields() -> None:
    config = RunConfig(run_id="r", model={"name": "gpt", "config": {"d_model": 100, "n_head": 3}})
    with pytest.raises(ConfigError) as info:
        check_components(config)
    message = str(info.value)
    assert "run 'r'" in message and "model" in message
    assert "d_model" in message and "n_head" in message


def test_check_components_accepts_the_demo() -> None:
    check_components(RunConfig.demo())


def test_robust_aggregation_is_the_default_and_its_options_round_trip(tmp_path: Path) -> None:
    assert RunConfig.demo().training.aggregator == "centered_clip"
    options = {"tau": 2.5, "tau_mode": "absolute", "iterations": 8, "tolerance": 0.0, "bucket_size": 2}
    config = RunConfig(run_id="r", training={"aggregator": "centered_clip", "aggregator_options": options})
    config.to_toml(tmp_path / "run.toml")
    loaded = RunConfig.from_toml(tmp_path / "run.toml")
    assert loaded == config and loaded.training.aggregator_options == options
    check_components(loaded)


@pytest.mark.parametrize(
    "training, named",
    [
        ({"aggregator_options": {"tau": -1}}, "field 'tau'"),
        ({"aggregator_options": {"tau_mode": "scaled"}}, "'relative' or 'absolute'"),
        (
            {"aggregator": "trimmed_mean", "aggregator_options": {"tau": 1}},
            "unknown field 'tau' (known fields",
        ),
        ({"aggregator": "krum"}, "available: centered_clip, coordinate_median, mean, trimmed_mean"),
    ],
)
def test_check_components_names_the_bad_aggregator_option(training: dict, named: str) -> None:
    with pytest.raises(ConfigError, match="training.aggregator") as info:
        check_components(RunConfig(run_id="r", training=training))
    assert named in str(info.value)


def test_example_run_file_uses_robust_aggregation() -> None:
    config = RunConfig.from_toml(Path(__file__).resolve().parents[1] / "examples" / "run.toml")
    check_components(config)
    assert config.training.aggregator == "centered_clip" and "tau" in config.training.aggregator_options


# CLI flags derived from a model


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="where to compute",
        json_schema_extra={"cli_aliases": {"--gpu": "gpu", "--cpu": "cpu"}},
    )
    verbose: bool = Field(False, description="say more")
    output: Path | None = Field(None, description="where to write results")
    port: int = Field(0, ge=0, le=65535, description="port to listen on")
    peer_limit: int = Field(
        8, ge=1, le=64, description="most peers", json_schema_extra={"cli_flag": "--max-peers"}
    )
    name: str = Field(default_factory=lambda: "box", description="display name")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tool")
    add_config_arguments(parser, _Settings)
    return parser


def _settings(*argv: str) -> _Settings:
    return config_from_args(_Settings, _parser().parse_args(list(argv)))


def test_defaults_come_from_the_model() -> None:
    assert _settings() == _Settings()


def test_flags_set_each_kind_of_field() -> None:
    settings = _settings(
        "--device", "cpu", "--verbose", "--output", "out/run", "--port", "8080", "--max-peers", "3"
    )
    assert settings.device == "cpu"
    assert settings.verbose is True
    assert settings.output == Path("out/run")
    assert settings.port == 8080
    assert settings.peer_limit == 3
    assert _settings("--no-verbose").verbose is False


@pytest.mark.parametrize(("flag", "device"), [("--gpu", "gpu"), ("--cpu", "cpu")])
def test_aliases_set_the_value(flag: str, device: str) -> None:
    assert _settings(flag).device == device


@pytest.mark.parametrize(
    "argv",
    [["--device", "cpu", "--gpu"], ["--gpu", "--cpu"], ["--device", "tpu"], ["--peer-limit", "3"]],
    ids=["flag-and-alias", "two-aliases", "not-a-choice", "field-name-instead-of-cli-flag"],
)
def test_argparse_refuses_bad_flag_combinations(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2


def test_out_of_bounds_int_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"^--port: .*less than or equal to 65535"):
        _settings("--port", "70000")


def test_cli_flag_override_names_its_own_flag_in_errors() -> None:
    with pytest.raises(ConfigError, match=r"^--max-peers: .*greater than or equal to 1"):
        _settings("--max-peers", "0")


def test_alias_help_names_the_flag_it_stands_for() -> None:
    # `tool --help` should say "--gpu  same as --device gpu", not repeat "--gpu".
    text = _parser().format_help()
    assert "same as --device gpu" in text
    assert "same as --device cpu" in text


def test_help_never_shows_pydantics_placeholder_for_factory_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A field with default_factory (like PeerConfig.name) has no plain default to show.
    from peer.cli import build_parser

    assert "PydanticUndefined" not in _parser().format_help()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["join", "--help"])
    text = capsys.readouterr().out
    assert "--name NAME" in text
    assert "PydanticUndefined" not in text


def test_peer_cli_parses_join_with_gpu() -> None:
    from peer.cli import build_parser
    from peer.config import PeerConfig

    args = build_parser().parse_args(["join", "--coordinator", "127.0.0.1:1", "--gpu"])
    assert args.command == "join"
    config = config_from_args(PeerConfig, args)
    assert config.coordinator == "127.0.0.1:1"
    assert config.device == "gpu"


def test_peer_cli_refuses_missing_coordinator() -> None:
    from peer.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["join", "--gpu"])


def test_coordinator_cli_parses_status_as_json() -> None:
    from coordinator.cli import StatusConfig, build_parser

    args = build_parser().parse_args(["status", "--coordinator", "h:1", "--json"])
    assert args.command == "status"
    config = config_from_args(StatusConfig, args)
    assert config.coordinator == "h:1"
    assert config.as_json is True


def test_coordinator_cli_bad_port_names_the_flag() -> None:
    from coordinator.cli import build_parser
    from coordinator.config import CoordinatorConfig

    args = build_parser().parse_args(["start", "--port", "-1"])
    with pytest.raises(ConfigError, match="^--port:"):
        config_from_args(CoordinatorConfig, args)
