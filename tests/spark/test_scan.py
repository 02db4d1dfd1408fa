"""The driver's scan reads UUIDs as text (`text_uuid_ints`): its fast path for canonical texts must
give exactly the ints the per-message path gives (`uuid_from_str`, as the tasks read them), and any
other text (braces, moved hyphens, whitespace, a bad digit, "" or none) must go the per-message way,
so the scan never gives an invalid line, which a task skips as garbage, a producer state."""

from __future__ import annotations

import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from tidings.spark.schema import UuidText, _text_uuid_int, text_uuid_ints


def _odd(u: uuid.UUID) -> st.SearchStrategy[str | None]:
    s = str(u)
    return st.sampled_from(
        [
            None, "", "{" + s + "}", "urn:uuid:" + s, s.replace("-", ""), s[:7] + "-" + s[7:].replace("-", "", 1),
            s[:20] + " " + s[21:], s[:5] + "g" + s[6:], s + " ", s[:35], s.upper(), "+" + s.replace("-", "")[1:],
        ]
    )  # fmt: skip


canonical = st.builds(uuid.UUID, int=st.integers(0, (1 << 128) - 1)).map(
    lambda u: str(u) if u.int % 3 else str(u).upper()
)
texts = st.lists(st.one_of(canonical, st.builds(uuid.UUID, int=st.integers(0, (1 << 128) - 1)).flatmap(_odd)),
                 min_size=1, max_size=12)  # fmt: skip


def _as_ints(got) -> list[int | None]:
    if isinstance(got, list):
        return got
    return [(int(h) << 64) | int(lo) for h, lo in got.tolist()]


@settings(max_examples=600, deadline=None)
@given(texts=st.one_of(st.lists(canonical, min_size=1, max_size=12), texts))
def test_text_uuid_ints_is_uuid_from_str_per_message(texts: list[str | None]) -> None:
    got = text_uuid_ints([UuidText(t) for t in texts])
    assert _as_ints(got) == [_text_uuid_int(t) for t in texts]
    if not isinstance(got, list):
        assert all(t is not None and len(t) == 36 for t in texts)  # (only canonical texts take the fast path)


def test_a_text_of_37_and_one_of_35_characters_do_not_pass_as_two_canonical_ones() -> None:
    """Joined, their hyphens may fall where two canonical texts' do and their digits count 64; each
    is invalid alone (33 and 31 hex digits), and must stay so, not become two UUIDs."""
    a = "01234567-89ab-1def-8123-456789abcdef0"  # 37: 33 hex digits
    b = "1234567-89ab-1def-8123-456789abcdef"  # 35: 31 hex digits
    assert [_text_uuid_int(t) for t in (a, b)] == [0, 0]
    assert _as_ints(text_uuid_ints([UuidText(a), UuidText(b)])) == [0, 0]
