"""Algorithm 3's credit ledger: per-adapter credit, transfers, and the starving/normal states.

Unit: seconds. When the policy runs a batch other than the FCFS batch B_fcfs, every adapter with a
request in B_fcfs that the priority batch P left out (a *receiver*) earns the duration of that
step, and the adapters served in P (the *payers*) pay the total between them, in proportion to
their number of requests in P. So an adapter's credit rises by one second per second its
FCFS-due requests are held back, and total credit is conserved by transfers.

Choices where the paper is silent (Appendix A):
- The amount: the paper's transfer_credit(P, B_fcfs) gives no unit. Per-adapter seconds make
  T_starve a time: an adapter that starts at `initial_credit` is served first after at most
  `t_starve - initial_credit` seconds of being held back.
- Payers: all adapters in P, not only the requests that jumped ahead of B_fcfs. A merged adapter
  whose requests all lie inside B_fcfs still shrank the batch and pays; a starving adapter pays
  for its priority even when the rest of the batch is filled (see dynamic_batching.py).
- An adapter is never paid for being held back by itself (payers are not receivers).
- Relaxation (not in the paper): credit moves back toward `initial_credit` at
  `credit_relax_per_s`, except for adapters held back in the step just settled. Without it a
  hot adapter that spent its credit could merge again only once the adapters it held back starve
  and pay it back; with deficits recovering but surpluses kept, the total credit would grow until
  adapters starve at the slightest delay. Held-back adapters keep earning at the full rate, so
  the starvation bound is unchanged. 0 gives the paper's closed ledger.
- The base model (key None) has an account like an adapter: it is compensated, and it can starve.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dlora.scheduling.types import AdapterKey, RequestView


@dataclass(frozen=True, slots=True)
class Transfer:
    """A transfer owed for one step, settled once the step's duration is known."""

    payers: Mapping[AdapterKey, int]  # adapter -> its requests in the priority batch
    receivers: frozenset[AdapterKey]


def transfer_for(priority: Iterable[RequestView], fcfs: Iterable[RequestView]) -> Transfer | None:
    """transfer_credit(P, B_fcfs) of Alg. 3 lines 14/20: who pays whom; None if nobody is held back."""
    payers = Counter(r.adapter for r in priority)
    chosen = {r.req_id for r in priority}
    receivers = frozenset(r.adapter for r in fcfs if r.req_id not in chosen) - payers.keys()
    if not receivers or not payers:
        return None
    return Transfer(dict(payers), receivers)


class CreditLedger:
    def __init__(self, initial: float, t_starve: float, t_normal: float, relax_per_s: float) -> None:
        self.initial, self.t_starve, self.t_normal = initial, t_starve, t_normal
        self.relax_per_s = relax_per_s
        self.credits: dict[AdapterKey, float] = {}
        self.starving: set[AdapterKey] = set()

    def ensure(self, adapters: Iterable[AdapterKey]) -> None:
        """New adapters get the initial credit when first seen."""
        for a in adapters:
            self.credits.setdefault(a, self.initial)

    def credit(self, adapter: AdapterKey) -> float:
        return self.credits.get(adapter, self.initial)

    def relax(self, dt: float, held_back: Iterable[AdapterKey] = ()) -> None:
        """Move every credit toward the initial value by relax_per_s·dt, except `held_back`."""
        step = self.relax_per_s * dt
        if step <= 0:
            return
        exempt = set(held_back)
        for a, c in self.credits.items():
            if a not in exempt:
                toward = min(self.initial, c + step) if c < self.initial else max(self.initial, c - step)
                self.credits[a] = toward

    def prune(self, keep: Iterable[AdapterKey]) -> None:
        """Forget normal adapters back at the initial credit (the value they would get again)."""
        keep = set(keep)
        for a in [a for a, c in self.credits.items() if c == self.initial and a not in keep]:
            if a not in self.starving:
                del self.credits[a]

    def settle(self, transfer: Transfer, seconds: float, present: set[AdapterKey]) -> list[AdapterKey]:
        """Pay each receiver still present `seconds`; payers share the total. Returns the paid."""
        receivers = [a for a in transfer.receivers if a in present]
        total = seconds * len(receivers)
        if total <= 0:
            return []
        self.ensure(receivers)
        self.ensure(transfer.payers)
        weight = sum(transfer.payers.values())
        for a in receivers:
            self.credits[a] += seconds
        for a, n in transfer.payers.items():
            self.credits[a] -= total * n / weight
        return receivers

    def update_states(self) -> frozenset[AdapterKey]:
        """Alg. 3 lines 6–10: starving above t_starve, normal again below t_normal."""
        for a, c in self.credits.items():
            if a in self.starving and c < self.t_normal:
                self.starving.discard(a)
            elif c > self.t_starve:
                self.starving.add(a)
        return frozenset(self.starving)
