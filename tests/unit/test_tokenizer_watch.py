"""TokenizerWatch: which generations no tokenizer holds any more (a tokenizer died or restarted), without ever
declaring lost what a slow tokenizer still holds, what was sent after the answers came, or what a tokenizer that
has not answered yet may hold."""
from __future__ import annotations

from services.gateway.tokenizer_watch import TokenizerWatch


def test_nothing_is_lost_before_any_tokenizer_answers() -> None:
    watch = TokenizerWatch(num_tokenizers=1, dead_after_s=30.0)
    assert watch.lost({"r1": 0.0}, now=100.0) == []  # an older tokenizer never answers: no one is declared lost


def test_held_requests_and_requests_newer_than_the_pings_are_not_lost() -> None:
    watch = TokenizerWatch(num_tokenizers=2, dead_after_s=30.0)
    watch.on_pong("tok0", "a", ping_sent_at=1.0, held=["r1"], now=1.1)
    watch.on_pong("tok1", "b", ping_sent_at=1.5, held=["r2"], now=1.6)
    sent = {"r1": 0.5, "r2": 0.5, "r3": 1.2, "r4": 0.2}
    assert watch.lost(sent, now=2.0) == ["r4"]  # r3 was sent after tok0's answered ping: it may be on its way


def test_a_tokenizer_that_has_not_answered_may_hold_anything() -> None:
    """Pings and requests share the DEALER's round robin: every ping may reach tok0 while the request went to tok1."""
    watch = TokenizerWatch(num_tokenizers=2, dead_after_s=30.0)
    watch.on_pong("tok0", "a", ping_sent_at=1.0, held=[], now=1.1)
    watch.on_pong("tok0", "a", ping_sent_at=2.0, held=[], now=2.1)
    assert watch.lost({"r1": 0.5}, now=2.2) == []
    watch.on_pong("tok1", "b", ping_sent_at=2.5, held=[], now=2.6)  # now both answered after r1 and none holds it
    assert watch.lost({"r1": 0.5}, now=2.7) == ["r1"]


def test_a_restarted_tokenizer_loses_what_its_last_incarnation_held() -> None:
    watch = TokenizerWatch(num_tokenizers=2, dead_after_s=30.0)  # tok1 never answers: coverage never completes
    assert not watch.on_pong("tok0", "a", ping_sent_at=1.0, held=["r1", "r2"], now=1.1)
    assert watch.on_pong("tok0", "b", ping_sent_at=3.0, held=[], now=3.1)
    assert watch.lost({"r1": 0.5, "r2": 0.6, "r5": 3.5}, now=3.2) == ["r1", "r2"]
    assert watch.lost({"r5": 3.5}, now=3.3) == []


def test_a_late_answer_does_not_replace_a_newer_one() -> None:
    watch = TokenizerWatch(num_tokenizers=1, dead_after_s=30.0)
    watch.on_pong("tok0", "a", ping_sent_at=2.0, held=["r1"], now=2.1)
    watch.on_pong("tok0", "a", ping_sent_at=1.0, held=[], now=2.2)  # crossed in flight
    assert watch.lost({"r1": 0.5}, now=2.3) == []


def test_a_silent_tokenizer_counts_until_dead_after_s_then_its_requests_are_lost() -> None:
    watch = TokenizerWatch(num_tokenizers=2, dead_after_s=30.0)
    watch.on_pong("tok0", "a", ping_sent_at=1.0, held=["r1"], now=1.0)  # then it stops answering (busy or dead)
    for t in (1.0, 10.0, 20.0, 30.0):
        watch.on_pong("tok1", "b", ping_sent_at=t, held=[], now=t)
        assert watch.lost({"r1": 0.5}, now=t) == []  # busy is not dead
    watch.on_pong("tok1", "b", ping_sent_at=32.0, held=[], now=32.0)
    assert watch.lost({"r1": 0.5}, now=32.0) == ["r1"]
