"""``swarm-peer``: donate a GPU or CPU to a run.

Example::

    swarm-peer join --coordinator run.example.org:31330 --gpu --name my-box
"""

from __future__ import annotations

import argparse
import sys

from peer.config import PeerConfig
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(PeerConfig, args)
        runtime.setup_logging(config.log_level)
        return runtime.run(_join(config))
    except SwarmError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        if isinstance(e, ConfigError):
            return 2
        return 3 if isinstance(e, SecurityError) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
