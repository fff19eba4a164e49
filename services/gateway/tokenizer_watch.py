"""Which of the gateway's generations no tokenizer holds any more (pure core: no sockets, time passed in).

The gateway's one DEALER spreads requests over the tokenizers, so it does not know which tokenizer took which.
It pings them in turn; each answers with its name, its incarnation (new at every start) and the ids of this
gateway's requests it holds, echoing the time the ping was sent. A generation sent before every live tokenizer's
latest answer was asked for, and held by none of them, was lost with a tokenizer that died or restarted (a
restarted one answers under its old name with a new incarnation and holds nothing): the gateway fails it with a
coded error instead of leaving its client waiting.

Busy is not dead: a tokenizer that answers late is still live, and its holdings count, for dead_after_s since its
last answer; only then is it forgotten. A tokenizer that never answers (an older protocol) makes no one lost.

    sent at t ──▶ ping p (sent_at > t) ──▶ pong from every live tokenizer, r in none of them ──▶ r lost
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
    def __init__(self, dead_after_s: float) -> None:
        self.dead_after_s = dead_after_s
        self.tokenizers: dict[str, TokenizerState] = {}  # name (its bound address) → what it last said

    def on_pong(self, name: str, incarnation: str, ping_sent_at: float, held: list[str], now: float) -> bool:
        """Record a tokenizer's answer; True when it is a new incarnation of a known name (it restarted)."""
        known = self.tokenizers.get(name)
        if known is not None and known.incarnation == incarnation and known.ping_sent_at > ping_sent_at:
            return False  # an answer older than the one recorded (answers to pings in flight can cross)
        self.tokenizers[name] = TokenizerState(incarnation, ping_sent_at, now, set(held))
        return known is not None and known.incarnation != incarnation

    def lost(self, sent_at: dict[str, float], now: float) -> list[str]:
        """The request ids of sent_at (id → when sent) that no live tokenizer holds, though every live one has
        answered a ping sent after them. Tokenizers silent for dead_after_s are forgotten first."""
        for name in [n for n, t in self.tokenizers.items() if now - t.answered_at > self.dead_after_s]:
            del self.tokenizers[name]
        if not self.tokenizers:
            return []
        covered_before = min(t.ping_sent_at for t in self.tokenizers.values())
        return [rid for rid, at in sent_at.items()
                if at < covered_before and not any(rid in t.held for t in self.tokenizers.values())]
