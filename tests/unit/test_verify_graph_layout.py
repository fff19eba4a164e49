"""The host layout of a speculative verify graph's replay (cuda_graphs.verify_layout): every real token where the eager
path (model_runner.eager_inputs) puts it, padding into slot 0 after the real tokens, and the gathered logit rows the
eager path's rows in its order; fits_verify sends every other step eager."""
from __future__ import annotations

from services.gpu_worker.batch_policy import ScheduledItem
from services.gpu_worker.cuda_graphs import fits_verify, verify_layout
from services.gpu_worker.model_runner import eager_inputs
from services.gpu_worker.request import SamplingParams
from services.gpu_worker.sequence import Sequence

PAGE = 4
Q = 4  # k = 3 drafts at most


def _decode(seq_id: int, num_tokens: int, pages: list[int], drafts: list[int], max_tokens: int = 64) -> ScheduledItem:
    """A decoding sequence (KV for all but its last token), scheduled with these drafts."""
    tokens = [100 * seq_id + i for i in range(num_tokens)]
    seq = Sequence(seq_id, f"r{seq_id}", 0, tokens, num_tokens - 1, SamplingParams(max_tokens=max_tokens), 0.0)
    seq.page_ids, seq.num_computed, seq.draft_token_ids = pages, num_tokens - 1, list(drafts)
    return ScheduledItem(seq, 1 + len(drafts), True, len(drafts))


def _items() -> list[ScheduledItem]:
    return [_decode(1, 6, [7, 3, 6], [61, 62, 63]),  # k drafts: positions 5..8, crossing into page 6 (reserved)
            _decode(2, 3, [9], []),  # a plain decode in the same step: 3 padding tokens
            _decode(3, 8, [2, 5, 11], [81])]  # one draft: positions 7, 8; 2 padding


def test_layout_pins_each_row_with_its_padding() -> None:
    layout = verify_layout(_items(), Q, PAGE)
    assert layout.input_ids == [105, 61, 62, 63, 202, 0, 0, 0, 307, 81, 0, 0]
    assert layout.positions == [5, 6, 7, 8, 2, 3, 4, 5, 7, 8, 9, 10]
    # page 3 holds positions 4..7 (slots 12..15), page 6 position 8 (slot 24); padding → slot 0
    assert layout.slots == [13, 14, 15, 24, 38, 0, 0, 0, 23, 44, 0, 0]
    assert layout.seq_lens == [9, 6, 11]  # first position + Q: the Q tokens are the last Q of each row
    assert layout.pages == [[7, 3, 6], [9], [2, 5, 11]]
    assert layout.logit_rows == [0, 1, 2, 3, 4, 8, 9]


def test_real_tokens_match_the_eager_path_and_padding_stays_out_of_real_pages() -> None:
    items = _items()
    layout = verify_layout(items, Q, PAGE)
    ids, positions, slots, query_start, _, logit_rows = eager_inputs(items, PAGE)
    # the eager token r of row i sits at padded row i * Q + r
    real = [i * Q + r for i in range(len(items)) for r in range(query_start[i + 1] - query_start[i])]
    assert [layout.input_ids[j] for j in real] == ids
    assert [layout.positions[j] for j in real] == positions
    assert [layout.slots[j] for j in real] == slots
    padding = sorted(set(range(len(items) * Q)) - set(real))
    assert [layout.slots[j] for j in padding] == [0] * len(padding)
    assert all(layout.positions[j] > layout.positions[j - 1] for j in padding)  # after its row's real tokens
    # gathered rows in the eager order: eager logit row m is token real[m]'s row
    assert layout.logit_rows == [real[m] for m in logit_rows]


def test_fits_verify_sends_other_steps_eager() -> None:
    width = 3  # pages per page-table row: positions up to 12
    assert fits_verify(_items(), Q, 4, width, PAGE)
    assert not fits_verify(_items(), Q, 2, width, PAGE)  # more rows than the largest bucket
    assert not fits_verify(_items(), 3, 4, width, PAGE)  # 3 drafts do not fit Q = 3
    assert not fits_verify([_decode(1, 10, [7, 3, 4], [1])], Q, 4, width, PAGE)  # positions 9..12: past 3 pages
    assert fits_verify([_decode(1, 9, [7, 3, 4], [1])], Q, 4, width, PAGE)  # positions 8..11: the last page's end
    prefill = _decode(4, 5, [8, 6], [])
    prefill.seq.num_computed = 2
    prefill.num_new_tokens = 3  # a chunk of 3 prompt tokens
    assert not fits_verify(_items() + [prefill], Q, 8, width, PAGE)
    pending = _decode(5, 4, [10], [1, 2])
    pending.seq.num_pending = 1  # its input token is still on the device
    assert not fits_verify([pending], Q, 4, width, PAGE)
    assert not fits_verify([_decode(6, 4, [10], [1], max_tokens=0)], Q, 4, width, PAGE)
    assert not fits_verify([], Q, 4, width, PAGE)
