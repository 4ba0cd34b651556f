"""``swarm-peer``: donate a GPU or CPU to a run.

Examples::

    swarm-peer doctor --coordinator run.example.org:31330     # check before joining
    swarm-peer join --coordinator run.example.org:31330 --gpu --name my-box
    swarm-peer pause                                          # from another terminal; resume continues
"""

from __future__ import annotations

import swarm.procenv  # noqa: F401  # isort: skip  (before grpc loads: see its docstring)

import argparse
import sys

from peer.config import PeerConfig
from peer.control import ControlConfig, send
from peer.doctor import DoctorConfig, run_doctor
from protocols.errors import ConfigError, SecurityError, SwarmError
from swarm import runtime
from swarm.cliargs import add_config_arguments, config_from_args


async def _join(config: PeerConfig) -> int:
    from peer.volunteer import Volunteer

    return await Volunteer(config).run(runtime.stop_event_on_signals())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-peer", description="Take part in a swarm training run.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_config_arguments(
        commands.add_parser("join", help="join a run and contribute until stopped"), PeerConfig
    )
    add_config_arguments(
        commands.add_parser("doctor", help="check this machine and the coordinator before joining"),
        DoctorConfig,
    )
    add_config_arguments(
        commands.add_parser("pause", help="pause a running peer: it stays in the run and keeps its credit"),
        ControlConfig,
    )
    add_config_arguments(commands.add_parser("resume", help="resume a paused peer"), ControlConfig)
    return parser


def _control(command: str, config: ControlConfig) -> int:
    state = send(command, config.identity.expanduser(), timeout_s=config.timeout_s)
    verb = "paused" if command == "pause" else "resumed"
    print(f"{verb} peer (pid {state['pid']}) at step {state.get('step', 0):.0f}; it stays in the run")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "doctor":
            return run_doctor(config_from_args(DoctorConfig, args))
        if args.command in ("pause", "resume"):
            return _control(args.command, config_from_args(ControlConfig, args))
        config = config_from_args(PeerConfig, args)
        runtime.setup_logging(config.log_level)
        return runtime.run(_join(config), fork_server=True)
    except SwarmError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        if isinstance(e, ConfigError):
            return 2
        return 3 if isinstance(e, SecurityError) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
