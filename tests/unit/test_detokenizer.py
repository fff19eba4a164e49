"""Tests of incremental detokenizing and stop strings, with the real bundled tokenizer and a toy decoder."""
from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.tokenizer.detokenizer import (
    IncrementalDetokenizer,
    SampleDetokenizer,
    StopStringMatcher,
)
from services.tokenizer.model_files import load_tokenizer

EMOJI_TEXT = "héllo 😀🎉 世界 ∑ done"
EMOJI_IDS = [88, 2756, 31394, 40303, 218, 10813, 232, 227, 216, 7906, 240, 178, 239, 230, 19995, 235, 2294]
STOP_TEXT_IDS = [19556, 905, 28, 260, 1112, 30, 2783]  # Hello| world|,| the| end|.| More
IM_END = 2


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("bundled")


class ToyDecoder:
    """Token id i is the string VOCAB[i]; special ids are skippable."""

    def __init__(self, vocab: list[str], special: frozenset[int] = frozenset()) -> None:
        self.vocab = vocab
        self.special = special

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.vocab[i] for i in token_ids if not (skip_special_tokens and i in self.special))


def feed_each(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add_token(i) for i in ids]


def test_bundled_ids_are_as_pinned(tok) -> None:
    assert tok.encode(EMOJI_TEXT) == EMOJI_IDS
    assert tok.encode("Hello world, the end. More") == STOP_TEXT_IDS


def test_multibyte_characters_wait_for_their_last_byte(tok) -> None:
    detok = IncrementalDetokenizer(tok)
    deltas = feed_each(detok, EMOJI_IDS)
    assert deltas == ["h", "é", "llo", "", " 😀", "", "", "🎉", " ", "", "世", "", "", "界", "", " ∑", " done"]
    assert detok.flush() == ""
    assert "".join(deltas) == EMOJI_TEXT


def test_flush_emits_a_truncated_character_as_decode_does(tok) -> None:
    detok = IncrementalDetokenizer(tok)
    ids = EMOJI_IDS[:6]  # "héllo 😀" and the first bytes of 🎉
    deltas = feed_each(detok, ids)
    assert deltas == ["h", "é", "llo", "", " 😀", ""]
    assert detok.flush() == "\ufffd"
    assert "".join(deltas) + "\ufffd" == tok.decode(ids)
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(tok) -> None:
    ids = STOP_TEXT_IDS[:2] + [IM_END]
    assert "".join(feed_each(IncrementalDetokenizer(tok, skip_special_tokens=True), ids)) == "Hello world"
    assert "".join(feed_each(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)) == \
        "Hello world<|im_end|>"


def test_prompt_context_is_not_emitted(tok) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    detok = IncrementalDetokenizer(tok, context_ids=prompt)
    assert feed_each(detok, STOP_TEXT_IDS[:3]) == ["Hello", " world", ","]


def test_stop_string_across_tokens_is_never_partly_emitted(tok) -> None:
    sample = SampleDetokenizer(tok, stops=["the end"])
    steps = [sample.step([i], is_final=False) for i in STOP_TEXT_IDS[:5]]
    assert [s.text for s in steps] == ["Hello", " world", ",", " ", ""]
    assert [s.is_stopped for s in steps] == [False, False, False, False, True]
    assert sample.is_finished and sample.text == "Hello world, " and sample.num_tokens == 5
    assert sample.step([30], is_final=True).text == ""


def test_stop_in_a_multi_token_step_cuts_the_tokens(tok) -> None:
    sample = SampleDetokenizer(tok, stops=[" end."])
    step = sample.step(STOP_TEXT_IDS, is_final=False)
    assert (step.text, step.num_tokens, step.is_stopped) == ("Hello world, the", 6, True)


def test_stop_at_the_very_start(tok) -> None:
    sample = SampleDetokenizer(tok, stops=["Hello"])
    step = sample.step(STOP_TEXT_IDS, is_final=False)
    assert (step.text, step.num_tokens, step.is_stopped) == ("", 1, True)
    assert sample.is_finished


def test_stop_string_inside_a_split_emoji(tok) -> None:
    sample = SampleDetokenizer(tok, stops=["🎉"])
    texts = [sample.step([i], is_final=False).text for i in EMOJI_IDS[:8]]
    assert texts == ["h", "é", "llo", "", " 😀", "", "", ""]
    assert sample.is_stopped and sample.text == "héllo 😀" and sample.num_tokens == 8


def test_held_back_tail_is_flushed_on_the_final_step(tok) -> None:
    sample = SampleDetokenizer(tok, stops=["the end"])
    first = sample.step(STOP_TEXT_IDS[:4], is_final=False)
    assert first.text == "Hello world, "
    last = sample.step([], is_final=True)
    assert (last.text, last.is_stopped, sample.is_finished) == ("the", False, True)


def test_no_decoder_gives_no_text() -> None:
    sample = SampleDetokenizer(None, stops=["x"])
    step = sample.step([5, 6], is_final=True)
    assert (step.text, step.num_tokens, step.is_stopped, sample.is_finished) == ("", 2, False, True)


def test_matcher_picks_the_earliest_of_several_stops() -> None:
    matcher = StopStringMatcher(["cd", "bcx", ""])
    assert matcher.feed("ab") == "a"  # "b" could start "bcx"
    assert matcher.feed("cde") == "b"
    assert matcher.is_stopped and matcher.text == "ab"
    assert matcher.feed("more") == "" and matcher.flush() == ""


def test_matcher_without_stops_emits_everything() -> None:
    matcher = StopStringMatcher([])
    assert [matcher.feed(t) for t in ("a", "", "bc")] == ["a", "", "bc"]
    assert matcher.flush() == "" and not matcher.is_stopped


def _expected(pieces: list[str], stops: list[str]) -> str:
    """The output a stream of pieces gives: the first piece that completes a stop ends it, cut at the
    earliest start among the stops complete by then (a stop that starts earlier but would complete later
    never gets the chance)."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s and s in text]
        if hits:
            return text[:min(hits)]
    return text


def test_the_first_stop_to_complete_wins_over_an_earlier_starting_one() -> None:
    sample = SampleDetokenizer(ToyDecoder(["a", "b"]), stops=["b", "aba"])
    texts = [sample.step([i], is_final=k == 2).text for k, i in enumerate([0, 1, 0])]
    assert texts == ["", "a", ""]  # "b" completes at the 2nd token; "aba", starting earlier, at the 3rd
    assert (sample.text, sample.is_stopped, sample.num_tokens) == ("a", True, 2)
    assert _expected(["a", "b", "a"], ["b", "aba"]) == "a"


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(["a", "b", "ab", "ba", "c", "<s>"]), max_size=20),
       stops=st.lists(st.text(alphabet="abc", min_size=0, max_size=4), max_size=3),
       step_size=st.integers(1, 4))
@example(pieces=["a", "b", "a"], stops=["b", "aba"], step_size=3)
@example(pieces=["ab"], stops=["b", "ab"], step_size=1)  # both complete with one piece: the earlier start wins
def test_any_split_yields_the_text_before_the_first_stop(pieces: list[str], stops: list[str],
                                                         step_size: int) -> None:
    vocab = ["a", "b", "ab", "ba", "c", "<s>"]
    decoder = ToyDecoder(vocab, special=frozenset({5}))
    ids = [vocab.index(p) for p in pieces]
    sample = SampleDetokenizer(decoder, stops=stops)
    chunks = [ids[i:i + step_size] for i in range(0, len(ids), step_size)] or [[]]
    out = "".join(sample.step(c, is_final=k == len(chunks) - 1).text for k, c in enumerate(chunks))
    full = "".join(p for p in pieces if p != "<s>")
    assert out == _expected([p for p in pieces if p != "<s>"], stops) == sample.text
    assert sample.is_stopped == any(s and s in full for s in stops)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("aé 😀世∑\n"), max_size=30), step_size=st.integers(1, 5))
def test_bundled_stream_equals_decode_and_is_valid_utf8(tok, text: str, step_size: int) -> None:
    ids = tok.encode(text)
    sample = SampleDetokenizer(tok)
    chunks = [ids[i:i + step_size] for i in range(0, len(ids), step_size)] or [[]]
    texts = [sample.step(c, is_final=k == len(chunks) - 1).text for k, c in enumerate(chunks)]
    assert "".join(texts) == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in t for t in texts)


def test_model_ids_match_the_worker_naming() -> None:
    from services.tokenizer.model_files import model_id_for
    assert model_id_for("bundled") == model_id_for("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert model_id_for("random:tiny-llama") == "random:tiny-llama"
    assert model_id_for("/x/models--Qwen--Qwen3-0.6B/snapshots/abc") == "Qwen/Qwen3-0.6B"
    assert model_id_for("/x/y/mymodel/") == "mymodel"
    assert load_tokenizer("random:tiny-llama") is None


def test_newest_cache_dir_with_tokenizer_files_wins(tmp_path, monkeypatch) -> None:
    import os

    from services.tokenizer.model_files import newest_cache_dir
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    assert newest_cache_dir() is None
    for age_s, name, has_files in ((300, "a", True), (100, "b", True), (0, "c", False)):
        path = tmp_path / f"smollm2-135m-instruct-{name}"
        path.mkdir()
        if has_files:
            (path / "tokenizer.json").write_text("{}")
            (path / "tokenizer_config.json").write_text("{}")
        os.utime(path, (1e9 - age_s, 1e9 - age_s))
    assert newest_cache_dir() == tmp_path / "smollm2-135m-instruct-b"
