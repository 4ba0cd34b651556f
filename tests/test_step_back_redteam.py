"""Rule 6 of the catch-up rule (``swarm.training.catchup.step_back_target``) against a peer that holds the code,
and against the run's own timing: each test failed on the first version of the rule (what the peers at
``max_steps`` do is in ``tests/test_step_back_redteam2.py``).

The situation is the one rule 6 was made for (``tests/test_step_back.py``): four peers whose run's minimum
group size is all four; ``lone`` applied a round at step 4 that ``a``, ``b`` and ``c`` did not, so it sits
alone at step 5 and they cannot form a round at step 4 without it."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.training.catchup import STEP_BACK_ROUNDS, Position, catch_up_move

BEFORE, MINE = Position(4, "h4"), Position(5, "h5-alone")
TRAINING = SimpleNamespace(round_s=10.0, max_steps=10)
LONG = 2 * TRAINING.round_s + 1  # rule 2's long stall: the peers behind may follow a groupmate ahead
BACK = STEP_BACK_ROUNDS * TRAINING.round_s + 1  # rule 6: the peer ahead may go back
HONEST = ("a", "b", "c")
CREDIT = {"a": 100.0, "b": 90.0, "c": 80.0, "lone": 95.0}  # credit decides; no Sybil key has any


def at(position: Position, *names: str) -> dict[str, Position]:
    return {name: position for name in names}


def lone_moves(others: dict[str, Position], stuck_s: float = BACK):
    """What the peer alone at step 5 does: its last round (with a, b and c) brought it from BEFORE to MINE."""
    return catch_up_move(
        MINE, others, TRAINING, stuck_s=stuck_s, trusted=set(HONEST), credit=CREDIT, me="lone", before=BEFORE
    )


def test_one_key_at_or_past_the_lone_peers_step_does_not_keep_the_run_stuck():
    """Before, any record at or past the caller's step, counted by identity and bounded by nothing, turned
    rule 6 off: one key with no credit showing step 5 under a hash nobody holds, or any step up to 2**63-1,
    kept the four peers from ever forming a round again (the same record also kept the peers behind from
    following the lone peer forward)."""
    honest_view = at(BEFORE, *HONEST)
    assert lone_moves(honest_view) == (4, "h4", ["a", "b", "c"])
    for sybil in (Position(5, "f" * 64), Position(6, "x"), Position(2**63 - 1, "x")):
        assert lone_moves({**honest_view, "sybil": sybil}) == (4, "h4", ["a", "b", "c"]), sybil
    # Counting keys (no credit yet): a key placed ahead is one of four others, and three hold BEFORE.
    counted = catch_up_move(
        MINE,
        {**honest_view, "s": Position(9, "x")},
        TRAINING,
        stuck_s=BACK,
        trusted=set(HONEST),
        before=BEFORE,
    )
    assert counted == (4, "h4", ["a", "b", "c"])


def test_in_a_run_of_three_the_peers_behind_follow_the_one_ahead_before_it_would_go_back():
    """With three peers, the two at step 4 see as many peers ahead as at their step, so once stalled twice a
    round time their groupmate ahead decides for them (rule 2). Before, the lone peer went back at that
    same moment (rule 6), and one step's state moved up to three times instead of once; now it waits a
    round time longer."""
    others = at(BEFORE, "a", "b")
    assert catch_up_move(MINE, others, TRAINING, stuck_s=LONG, trusted={"a", "b"}, before=BEFORE) is None
    for mate in ("a", "b"):
        view = {mate: BEFORE, "lone": MINE}
        forward = catch_up_move(BEFORE, view, TRAINING, stuck_s=LONG, trusted={mate, "lone"})
        assert forward == (5, "h5-alone", ["lone"])
    assert catch_up_move(MINE, others, TRAINING, stuck_s=BACK, trusted={"a", "b"}, before=BEFORE) == (
        4, "h4", ["a", "b"]
    )  # fmt: skip
