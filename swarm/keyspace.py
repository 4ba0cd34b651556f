"""Every DHT key a run uses, each with its check: the DHT denies by default.

hivemind hashes each key to a 160-bit ID before it reaches a node, so a node cannot tell a run's keys by
their names; it can tell them by their hashes. ``run_keys`` lists every key of a run in one place:

- the signed records (``<run>.progress``, ``.pipeline``, ``.members``, ``.checkpoint``, ``.bans``);
- pages 1 and on of the ban list (``<run>.bans.<k>``, ``swarm.bans``);
- each pipeline stage's checkpoint record (``<run>.stage<k>.checkpoint``, signed for the stage prefix),
  for every stage a run may have (``MAX_STAGES``);
- the matchmaking key of the run's averagers, of its second tier's (``<run>.tier2``, ``swarm.averaging.tiers``)
  and of each stage's (``<prefix>.0b``, signed declarations: ``swarm.averaging.declarations``).

``RunValidator`` routes each of these keys to its check and refuses every other key, so a stranger can
store nothing that is not a valid record of the run. Every DHT a peer or the coordinator starts runs it.
It also reads the ban list: a page signed by the run's coordinator that it accepts updates the node's
``swarm.dhtstorage.NODE_BANS``, and it refuses every entry a peer on the newest list signs (a node that
knows no coordinator key learns nothing from pages, which anyone could sign).

Example::

    start_dht(key, path, host="0.0.0.0", port=0, initial_peers=peers, validators=[RunValidator(run_id, ck)])
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from protocols.keys import PublicKey
from protocols.messages import MAX_BAN_PAGES
from swarm.averaging.declarations import MAX_DECLARATION_BYTES, matchmaking_key, open_declaration
from swarm.averaging.tiers import tier_prefix
from swarm.bans import BanPageValidator, ban_list_key, open_ban_page
from swarm.dhtstorage import NODE_BANS
from swarm.records import VALIDATED_KINDS, TrustValidator, record_key, stage_prefix

logger = logging.getLogger(__name__)

#: The most pipeline stages a run may have (``PipelineConfig.stages``); every stage's keys are listed.
MAX_STAGES = 64


@dataclass(frozen=True)
class KeyRule:
    """How one key is checked: ``check`` names the check, ``scope`` what its records are signed for
    (a run ID, a stage prefix or a matchmaking key) and ``arg`` the record kind or ban page."""

    check: str  # "record", "ban_page" or "declaration"
    scope: str
    arg: str | int | None = None


def run_keys(run_id: str, stages: int = MAX_STAGES) -> dict[str, KeyRule]:
    """Every DHT key of run ``run_id``, by name, with how its records are checked. ``stages``: the run's
    pipeline stages (1: a data-parallel run, which has no stage keys); only those stages' keys are listed,
    so an identity can hold no more entries on a node than the run has keys for it."""
    if not 1 <= stages <= MAX_STAGES:
        raise ValueError(f"a run has 1 to {MAX_STAGES} stages, not {stages}")
    keys = {record_key(run_id, kind): KeyRule("record", run_id, kind) for kind in VALIDATED_KINDS}
    keys.update(
        {ban_list_key(run_id, page): KeyRule("ban_page", run_id, page) for page in range(1, MAX_BAN_PAGES)}
    )
    prefixes = [run_id] + ([stage_prefix(run_id, stage) for stage in range(stages)] if stages > 1 else [])
    for prefix in prefixes[1:]:
        keys[record_key(prefix, "checkpoint")] = KeyRule("record", prefix, "checkpoint")
    for prefix in [*prefixes, tier_prefix(run_id)]:
        keys[matchmaking_key(prefix)] = KeyRule("declaration", matchmaking_key(prefix))
    return keys


class RunValidator(RecordValidatorBase):
    """hivemind record validator of one run that refuses every key ``run_keys`` does not list.

    Picklable (plain attributes only): the DHT runs it in its spawned child process.
    """

    def __init__(self, run_id: str, coordinator_key: PublicKey | None, *, stages: int = MAX_STAGES):
        self.run_id = run_id
        self.records = TrustValidator(run_id, coordinator_key)
        self.ban_pages = BanPageValidator(run_id, coordinator_key)
        self.rules = {
            DHTID.generate(source=name).to_bytes(): rule for name, rule in run_keys(run_id, stages).items()
        }

    def validate(self, record: DHTRecord) -> bool:
        rule = self.rules.get(record.key)
        if rule is None:
            logger.debug(f"refusing a record under a key run {self.run_id!r} does not use")
            return False
        if record.subkey in NODE_BANS:
            logger.debug(f"refusing a record signed by banned peer {NODE_BANS.subkeys[record.subkey]}")
            return False
        if rule.check == "record":
            valid = self.records.check(record, str(rule.arg), rule.scope)
            if valid and rule.arg == "bans" and rule.scope == self.run_id:
                self._learn_bans(record)
            return valid
        if rule.check == "ban_page":
            valid = self.ban_pages.check(record, int(rule.arg))
            if valid:
                self._learn_bans(record)
            return valid
        raw = self.records.coordinator_raw
        return _check_declaration(
            record, rule.scope, self.run_id, PublicKey(raw) if raw is not None else None
        )

    def _learn_bans(self, record: DHTRecord) -> None:
        """Add the peers of a ban list page this validator accepted to the node's bans (only when the page's
        signature was checked against the coordinator's key)."""
        raw = self.records.coordinator_raw
        if raw is None:
            return
        body = open_ban_page(MSGPackSerializer.loads(record.value), self.run_id, PublicKey(raw))
        if body is not None and body.page < body.pages:
            NODE_BANS.add_page(body.changed_at, body.list_sha256, body.pages, body.page, body.banned)


def _check_declaration(
    record: DHTRecord, group_key: str, run_id: str, coordinator_key: PublicKey | None
) -> bool:
    try:
        if len(record.value) > MAX_DECLARATION_BYTES + 16 or len(record.subkey) > MAX_DECLARATION_BYTES:
            raise ValueError("the entry is too large")
        subkey = MSGPackSerializer.loads(record.subkey)
        value = MSGPackSerializer.loads(record.value)
        open_declaration(
            group_key, subkey, value, record.expiration_time, run_id=run_id, coordinator_key=coordinator_key
        )
    except Exception as e:  # anything a stranger's bytes can raise: refuse the record, never crash
        logger.debug(f"refusing a declaration under {group_key!r}: {e}")
        return False
    return True
