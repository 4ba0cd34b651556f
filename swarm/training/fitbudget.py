"""A member's budget for fits (``swarm.training.sendercheck``'s ``_poor_fit``): what scoring a sender's input
against one of its own micro-batches, and the replays such scores point to, may cost it, one account per
sender."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

#: The most a member saves of its fit budget for a sender, in rounds of it: a sender named for no fit for a
#: while is not then scored many rounds' worth at once.
FIT_CREDIT_ROUNDS = 4
#: Rounds that name a sender in debt at a member before the rest of its debt is forgiven: a replay of an
#: honest sender as heavy as the member is paid back sooner (8 micro-batches plus the fit, against 16
#: rounds of 0.6 at 8 micro-batches and the run's share), so the cost holds to that share; a much heavier
#: sender's is forgiven in part, so a liar that buys a replay with one honest heavy round goes without
#: fits at that member for at most 16 rounds that name it.
FIT_DEBT_ROUNDS = 16
#: Senders a member keeps a fit account for: a group holds at most ``max_group_size``.
MAX_FIT_ACCOUNTS = 4096


class FitBudget:
    """What a member may still spend on fits, in micro-batches, one account per sender it scores: each round
    it may score in, it earns ``share`` (``sendercheck.FIT_SHARE``) of the micro-batches it computed, shared
    among the senders named for its fit that round (each account saving at most ``FIT_CREDIT_ROUNDS``
    rounds' worth), and a sender's account pays one for each fit of it scored (when it is picked) and the
    whole replay of it each time a poor fit pointed to it and the replay convicted nobody (found it honest,
    or could not finish); a replay that convicts costs nothing. A sender whose honest fit was replayed is
    not scored again at this member until its account is back above 0, or until ``FIT_DEBT_ROUNDS`` rounds
    that name it have passed since it went into debt, when the rest is forgiven (a liar that buys a replay
    with an honest heavy round buys at most that many rounds without fits there, and the stand-out scores
    and the draw still reach it). So fits and their replays cost a member at most ``share`` of its compute,
    but what is forgiven (replays of senders much heavier than the member); and a sender whose honest fits
    are poor (a heavy input fits one of its micro-batches more loosely) uses up its own fits at this
    member, not the others'. Accounts are kept for ``MAX_FIT_ACCOUNTS`` senders, the longest untouched
    dropped."""

    def __init__(self, share: float):
        self.share = share
        self.accounts: OrderedDict[str, float] = OrderedDict()
        # Senders in debt -> the rounds naming them left before the rest of their debt is forgiven.
        self._debt_rounds: dict[str, int] = {}

    @property
    def credit(self) -> float:
        """What all the accounts hold together (negative where some are in debt)."""
        return sum(self.accounts.values())

    def earn(self, own_micro_batches: float, senders: Sequence[str]) -> None:
        if not senders:
            return
        each = self.share * max(0.0, own_micro_batches) / len(senders)
        for sender in senders:
            credit = min(self.accounts.get(sender, 0.0) + each, FIT_CREDIT_ROUNDS * each)
            left = self._debt_rounds.pop(sender, FIT_DEBT_ROUNDS) - 1
            if credit < 0 and left > 0:
                self._debt_rounds[sender] = left
            elif credit < 0:  # in debt for FIT_DEBT_ROUNDS rounds that named it: the rest is forgiven
                credit = 0.0
            self._set(sender, credit)

    def afford(self, sender: str) -> float:
        """The probability of scoring ``sender``'s fit this round: its account's credit, at most 1."""
        return min(1.0, max(0.0, self.accounts.get(sender, 0.0)))

    def spend(self, sender: str, micro_batches: float) -> None:
        credit = self.accounts.get(sender, 0.0) - micro_batches
        if credit < 0:  # counted from its first round in debt: more debt does not lengthen it
            self._debt_rounds.setdefault(sender, FIT_DEBT_ROUNDS)
        self._set(sender, credit)

    def _set(self, sender: str, credit: float) -> None:
        self.accounts[sender] = credit
        self.accounts.move_to_end(sender)
        while len(self.accounts) > MAX_FIT_ACCOUNTS:
            dropped, _ = self.accounts.popitem(last=False)
            self._debt_rounds.pop(dropped, None)


__all__ = ["FIT_CREDIT_ROUNDS", "FIT_DEBT_ROUNDS", "MAX_FIT_ACCOUNTS", "FitBudget"]
