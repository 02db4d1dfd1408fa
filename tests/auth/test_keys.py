"""Keys parse by Gazette's rules (the first signs, any verifies, `AA==` admits requests without a token),
short keys are refused, and no error or repr ever shows a key: errors name its index."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tidings.auth import ALLOW_MISSING, KeySet, generate_key
from tidings.protocol.status import ValidationError

A = base64.b64encode(b"a" * 32).decode()
B = base64.b64encode(b"b" * 16).decode()  # (16 bytes: the least accepted)


@pytest.mark.parametrize(
    "text,keys,allow_missing",
    [
        pytest.param(A, [b"a" * 32], False, id="one"),
        pytest.param(f"{A},{B}", [b"a" * 32, b"b" * 16], False, id="comma"),
        pytest.param(f" {B}\n\t{A} , ", [b"b" * 16, b"a" * 32], False, id="spaces-and-newlines"),
        pytest.param(f"AA==,{A}", [b"a" * 32], True, id="allow-missing-first"),
        pytest.param(f"{A} {B} AA==", [b"a" * 32, b"b" * 16], True, id="allow-missing-last"),
    ],
)
def test_keys_parse_in_order_and_aa_only_admits_missing_tokens(
    text: str, keys: list[bytes], allow_missing: bool
) -> None:
    ks = KeySet.parse(text)
    assert list(ks.keys) == keys and ks.allow_missing is allow_missing
    assert ks.signing_key == keys[0]  # (AA== never signs)


SECRET = base64.b64encode(b"12345678").decode()  # an 8-byte key: refused, and never echoed


@pytest.mark.parametrize(
    "text,message",
    [
        pytest.param(
            f"{A},{SECRET}",
            "--auth-keys: key at index 1 is 8 bytes: HS256 wants 32 random bytes, e.g. `tidings auth keygen`",
            id="short",
        ),
        pytest.param(
            f"AA== {A} {SECRET[:-1]}",
            "--auth-keys: key at index 2 is not base64 (standard alphabet, = padding), e.g. `tidings auth keygen`",
            id="undecodable",
        ),
        pytest.param(
            f"{A} {base64.urlsafe_b64encode(bytes([251]) * 32).decode()}",
            "--auth-keys: key at index 1 is not base64",
            id="url-alphabet",
        ),
        pytest.param("AA==", "--auth-keys: only AA== (which admits requests without a token): give at least", id="aa"),
        pytest.param(" , ", "--auth-keys: no key: give at least one key, e.g. from `tidings auth keygen`", id="none"),
    ],
)
def test_a_bad_key_is_refused_by_its_index_never_its_value(text: str, message: str) -> None:
    with pytest.raises(ValidationError) as exc:
        KeySet.parse(text)
    assert str(exc.value).startswith(message), exc.value
    for word in text.replace(",", " ").split():
        if word != ALLOW_MISSING:
            assert word not in str(exc.value) and word[:8] not in str(exc.value)


def test_a_key_set_never_shows_its_keys() -> None:
    ks = KeySet.parse(f"AA==,{A}")
    assert repr(ks) == str(ks) == "KeySet(1 key, allow_missing=True)"
    assert A not in repr(ks) and "aaaa" not in repr(ks)


def test_keys_come_from_the_flag_or_the_file_never_both(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"{B}\n{A}\n")
    assert KeySet.from_sources(None, f) == KeySet((b"b" * 16, b"a" * 32))
    assert KeySet.from_sources(A, None) == KeySet((b"a" * 32,))
    assert KeySet.from_sources(None, None) is None and KeySet.from_sources("", None) is None  # (auth off)
    with pytest.raises(ValidationError, match=r"^--auth-keys and --auth-keys-file are both given: give one$"):
        KeySet.from_sources(A, f)


def test_a_key_file_error_names_the_file_and_the_index(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"{A}\n{SECRET}\n")
    with pytest.raises(ValidationError, match=f"^--auth-keys-file {f}: key at index 1 is 8 bytes"):
        KeySet.from_sources(None, f)
    with pytest.raises(ValidationError, match="cannot be read: No such file or directory"):
        KeySet.from_sources(None, tmp_path / "absent")
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(ValidationError, match="is not text"):
        KeySet.from_sources(None, f)


def test_generated_keys_are_32_random_bytes_that_parse() -> None:
    a, b = generate_key(), generate_key()
    assert a != b
    assert [len(k) for k in KeySet.parse(f"{a},{b}").keys] == [32, 32]
