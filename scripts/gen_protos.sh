#!/usr/bin/env bash
# Regenerates the Python code for protocols/*.proto (needs the dev extra: grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protocols/*.proto
