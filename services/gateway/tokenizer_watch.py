"""Which of the gateway's generations no tokenizer holds any more (pure core: no sockets, time passed in).

The gateway's one DEALER spreads requests over the tokenizers, so it does not know which tokenizer took which.
It pings them in turn; each answers with its name, its incarnation (new at every start) and the ids of this
gateway's requests it holds, echoing the time the ping was sent. A generation is lost when:

- the tokenizer that last said it held it answers as a new incarnation (it restarted) that does not hold it;
- that tokenizer has been silent for dead_after_s (busy is not dead: until then its holdings count);
- every tokenizer the gateway connects to has answered a ping sent after the generation, and none holds it (it went
  to a tokenizer that died before it could report it). With fewer tokenizers answering than the gateway connects to,
  this rule concludes nothing: the missing one may hold it.

A tokenizer that never answers (an older protocol) makes no one lost.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenizerState:
    incarnation: str
    ping_sent_at: float  # when the ping this tokenizer last answered was sent (the gateway's clock)
    answered_at: float
    held: set[str] = field(default_factory=set)


class TokenizerWatch:
    def __init__(self, num_tokenizers: int, dead_after_s: float) -> None:
        self.num_tokenizers = num_tokenizers  # how many the gateway connects to
        self.dead_after_s = dead_after_s
        self.tokenizers: dict[str, TokenizerState] = {}  # name (its bound address) → what it last said
        self._orphans: set[str] = set()  # held by a tokenizer that restarted or fell silent

    def on_pong(self, name: str, incarnation: str, ping_sent_at: float, held: list[str], now: float) -> bool:
        """Record a tokenizer's answer; True when it is a new incarnation of a known name (it restarted)."""
        known = self.tokenizers.get(name)
        if known is not None and known.incarnation == incarnation and known.ping_sent_at > ping_sent_at:
            return False  # an answer older than the one recorded (answers to pings in flight can cross)
        state = self.tokenizers[name] = TokenizerState(incarnation, ping_sent_at, now, set(held))
        if known is None or known.incarnation == incarnation:
            return False
        self._orphans |= known.held - state.held
        return True

    def lost(self, sent_at: dict[str, float], now: float) -> list[str]:
        """The request ids of sent_at (id → when sent) that no tokenizer holds any more (see the module's rules)."""
        for name in [n for n, t in self.tokenizers.items() if now - t.answered_at > self.dead_after_s]:
            self._orphans |= self.tokenizers.pop(name).held
        held_now = set().union(*(t.held for t in self.tokenizers.values()))
        self._orphans = {rid for rid in self._orphans - held_now if rid in sent_at}
        lost = set(self._orphans)
        if self.tokenizers and len(self.tokenizers) >= self.num_tokenizers:
            covered_before = min(t.ping_sent_at for t in self.tokenizers.values())
            lost |= {rid for rid, at in sent_at.items() if at < covered_before and rid not in held_now}
        self._orphans -= lost
        return sorted(lost, key=sent_at.__getitem__)
