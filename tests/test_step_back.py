"""Rule 6 of the catch-up rule (``swarm.training.catchup.step_back_target``): a peer alone one step ahead,
whose groupmates' part of its last round failed, goes back to where it was once it is long stalled and most
of the run holds that position; nothing else moves it back.

The decision logic in-process; ``tests/test_training.py`` has the same among real peers whose run's
minimum group size is every peer (before, they never formed a round again)."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.training.catchup import STEP_BACK_ROUNDS, Groupmates, Position, catch_up_move, step_back_target

BEFORE, MINE = Position(4, "h4"), Position(5, "h5-alone")
TRAINING = SimpleNamespace(round_s=10.0, max_steps=None)
LONG = STEP_BACK_ROUNDS * TRAINING.round_s + 1


def at(position: Position, *names: str) -> dict[str, Position]:
    return {name: position for name in names}


def test_a_long_stalled_peer_alone_ahead_goes_back_to_where_it_was_and_most_of_the_run_is():
    others = at(BEFORE, "a", "b", "c")
    assert catch_up_move(MINE, others, TRAINING, stuck_s=LONG, before=BEFORE) == (4, "h4", ["a", "b", "c"])
    # Not before it is long stalled: the others may be about to finish their round at step 4.
    assert catch_up_move(MINE, others, TRAINING, stuck_s=TRAINING.round_s + 1, before=BEFORE) is None
    assert catch_up_move(MINE, others, TRAINING, stuck_s=LONG) is None, "no round brought it here: never back"


def test_only_to_its_own_previous_position_one_step_back_and_only_where_most_peers_are():
    # Most of the run at another state of step 4 (a lie, or a round it was not in): not where it was.
    assert step_back_target(MINE, at(Position(4, "other"), "a", "b", "c"), BEFORE) is None
    # Where it was two steps back: never more than one step.
    two_back = Position(3, "h3")
    assert step_back_target(Position(5, "h5"), at(two_back, "a", "b", "c"), two_back) is None
    # Half of the others is no strict majority: two keys placed elsewhere keep it where it is.
    split = {**at(BEFORE, "a", "b"), **at(Position(4, "x"), "y", "z")}
    assert step_back_target(MINE, split, BEFORE) is None
    assert step_back_target(MINE, {**split, "c": BEFORE}, BEFORE).holders == ["a", "b", "c"]
    # Peers at its step or ahead (a groupmate as stuck as it is, or a key placed there) do not stop it while
    # most of the run is where it was: such a key would otherwise keep the run stuck for good.
    stuck = {**at(BEFORE, "a", "b", "c"), "d": Position(5, "h5-other"), "e": Position(6, "h6")}
    assert step_back_target(MINE, stuck, BEFORE).holders == ["a", "b", "c"]
    assert step_back_target(MINE, {**stuck, "f": Position(5, "h5-other")}, BEFORE) is None, (
        "3 of 6: no majority"
    )
    assert step_back_target(MINE, {}, BEFORE) is None


def test_once_credit_decides_keys_without_credit_neither_move_it_back_nor_serve_the_state():
    credit = {"a": 100.0, "b": 90.0, "c": 80.0, "me": 95.0}
    # Five fresh keys at its previous position outnumber the three credited peers elsewhere: no move.
    sybils = at(BEFORE, *[f"s{i}" for i in range(5)])
    elsewhere = at(Position(4, "other"), "a", "b", "c")
    assert step_back_target(MINE, {**sybils, **elsewhere}, BEFORE, credit=credit, me="me") is None
    # The credited peers at its previous position carry it, and only they serve the download.
    target = step_back_target(MINE, {**sybils, **at(BEFORE, "a", "b", "c")}, BEFORE, credit=credit, me="me")
    assert target is not None and target.holders == ["a", "b", "c"]


def test_groupmates_remember_where_the_last_round_began_only_while_the_peer_is_where_it_ended():
    mates = Groupmates()
    assert mates.before(MINE) is None
    mates.record(["a", "b"], 5, moved=(BEFORE, MINE))
    assert mates.before(MINE) == BEFORE
    assert mates.before(Position(5, "downloaded")) is None, "a download at the same step: not that round's"
    assert mates.before(Position(6, "h6")) is None
    mates.record(["a"], 6)  # a round recorded without its positions (a stage replica's): never back
    assert mates.before(Position(6, "h6")) is None
