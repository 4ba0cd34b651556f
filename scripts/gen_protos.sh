#!/usr/bin/env bash
# Regenerates the Python code for protocols/*.proto (needs the dev extra: grpcio-tools).
# Only coordinator.proto declares a gRPC service; averaging.proto's messages travel over hivemind's P2P.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. protocols/*.proto
python -m grpc_tools.protoc -I . --grpc_python_out=. protocols/coordinator.proto
