"""Protocol version and the size limits that every side enforces on what it reads."""

# 2: signed matchmaking declarations with certificates, signed stage replies and retries, Status in pages.
# 3: aggregates carry the reducer's signed time; the coordinator may demand the inputs behind one.
# 4: a stage replica checks its own answer before signing it (pipeline reply digest v2), so a signed
#    answer that fails the check is evidence against its signer (``stage_bad_answer``).
# 5: a diloco run that checks senders replays windows of a fresh inner optimizer, exactly inner_steps long:
#    a longer window that a version-4 peer signs would be a lie.
# 6: a validator also replays a sender whose input stands out among its chunk's (``swarm.averaging.scores``)
#    and files that evidence with the chunk's inputs: a version-5 coordinator would ban it as undrawn.
PROTOCOL_VERSION = 6

# Domain separator mixed into every signature, so a swarm signature is never valid for anything else.
SIGNATURE_DOMAIN = b"swarm/signed/v1"

MAX_GRPC_MESSAGE_BYTES = 1 << 20  # coordinator messages are small; tensors never go through it
MAX_ENVELOPE_BYTES = 256 << 10
MAX_STRING_CHARS = 4096
MAX_BINARY_BYTES = 256 << 10
MAX_CONTAINER_ITEMS = 4096
MAX_NESTING_DEPTH = 16
