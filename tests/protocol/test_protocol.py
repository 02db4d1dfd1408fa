"""The wire protocol: the generated code is current, every Status has one error class that names the next
step, and validators refuse a bad name, spec or chunk naming the field."""

from __future__ import annotations

import grpc
import pytest

from tidings.protocol import generate, labels, validate
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import status as st


def test_generated_code_is_current() -> None:
    assert generate.stale_files() == []


def test_every_non_ok_status_has_exactly_one_error_class() -> None:
    classes = {}
    for value in pb.Status.values():
        if value == pb.OK:
            continue
        cls = st.for_status(value)
        assert issubclass(cls, st.StatusError) and cls.status == value
        classes[value] = cls
    assert len(set(classes.values())) == len(classes)


def test_status_error_names_journal_status_and_next_step() -> None:
    err = st.IndexHasGreaterOffsetError("a/b")
    assert "a/b" in str(err) and "INDEX_HAS_GREATER_OFFSET" in str(err) and "reset-head" in str(err)
    assert not err.retriable
    assert st.WrongRouteError("a").retriable


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "boom"


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_every_grpc_code_maps_to_a_transport_error(code: grpc.StatusCode) -> None:
    err = st.map_grpc_error(_FakeRpcError(code), "127.0.0.1:1")
    said = "NOT_ALLOWED" if code == grpc.StatusCode.PERMISSION_DENIED else code.name  # (the Status a refusal is)
    assert isinstance(err, st.TransportError) and err.code == code and said in str(err)
    assert err.retriable == (code in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED})


def test_a_token_refusal_is_one_definite_line_naming_the_server_and_the_reason() -> None:
    """UNAUTHENTICATED and PERMISSION_DENIED become their own errors, never retried; a refusal of a
    capability is also the Status NOT_ALLOWED's error, with the reason (docs/design/production.md §3.9)."""

    class Refused(_FakeRpcError):
        def details(self) -> str:
            return "token lacks the APPEND capability (it has READ)"

    denied = st.map_grpc_error(Refused(grpc.StatusCode.PERMISSION_DENIED), "127.0.0.1:8080")
    assert isinstance(denied, st.PermissionDeniedError) and isinstance(denied, st.NotAllowedError)
    assert str(denied) == "NOT_ALLOWED from 127.0.0.1:8080: token lacks the APPEND capability (it has READ)"
    assert denied.reason == "token lacks the APPEND capability (it has READ)" and not denied.retriable
    assert not denied.refresh_route and denied.status == pb.NOT_ALLOWED
    unknown = st.map_grpc_error(Refused(grpc.StatusCode.UNAUTHENTICATED), "127.0.0.1:8080")
    assert isinstance(unknown, st.UnauthenticatedError) and not unknown.retriable
    assert str(unknown) == "UNAUTHENTICATED from 127.0.0.1:8080: token lacks the APPEND capability (it has READ)"
    assert st.for_status(pb.NOT_ALLOWED) is st.NotAllowedError and st.NotAllowedError("a/b").reason == ""


@pytest.mark.parametrize(
    "name,ok",
    [
        pytest.param("a", True, id="single"),
        pytest.param("examples/foo-bar_1.x=%+", True, id="all-chars"),
        pytest.param("", False, id="empty"),
        pytest.param("/a", False, id="leading-slash"),
        pytest.param("a/", False, id="trailing-slash"),
        pytest.param("a//b", False, id="empty-segment"),
        pytest.param("a/../b", False, id="dotdot"),
        pytest.param("a/./b", False, id="dot"),
        pytest.param("a b", False, id="space"),
        pytest.param("x" * 513, False, id="too-long"),
    ],
)
def test_journal_name_rules(name: str, ok: bool) -> None:
    if ok:
        validate.journal_name(name)
    else:
        with pytest.raises(st.ValidationError) as exc:
            validate.journal_name(name, "spec.name")
        assert exc.value.context == "spec.name"


def _spec(**kw: object) -> pb.JournalSpec:
    spec = pb.JournalSpec(
        name="a/b",
        replication=3,
        fragment=pb.JournalSpec.FragmentSpec(
            length=1 << 20, compression_codec=pb.NONE, stores=["file:///tmp/x/"], refresh_interval_ms=60000
        ),
    )
    for k, v in kw.items():
        target = spec.fragment if k in pb.JournalSpec.FragmentSpec.DESCRIPTOR.fields_by_name else spec
        setattr(target, k, v)
    return spec


@pytest.mark.parametrize(
    "change,context",
    [
        pytest.param({}, None, id="valid"),
        pytest.param({"replication": 0}, "spec.replication", id="replication-0"),
        pytest.param({"replication": 6}, "spec.replication", id="replication-6"),
        pytest.param({"length": 10}, "spec.fragment.length", id="tiny-fragment"),
        pytest.param({"compression_codec": pb.INVALID}, "spec.fragment.compression_codec", id="codec"),
        pytest.param({"refresh_interval_ms": 5}, "spec.fragment.refresh_interval", id="refresh"),
        pytest.param({"flags": 3}, "spec.flags", id="flags"),
        pytest.param({"max_append_rate": -1}, "spec.max_append_rate", id="rate"),
    ],
)
def test_journal_spec_validation(change: dict, context: str | None) -> None:
    spec = _spec(**change)
    if context is None:
        validate.journal_spec(spec)
    else:
        with pytest.raises(st.ValidationError) as exc:
            validate.journal_spec(spec)
        assert exc.value.context == context


def test_bad_store_url_is_named() -> None:
    spec = _spec()
    spec.fragment.stores[:] = ["ftp://nope"]
    with pytest.raises(st.ValidationError, match=r"stores\[0\]"):
        validate.journal_spec(spec)


def test_label_union_subtract_and_registers() -> None:
    a = labels.label_set({"owner": "x", "epoch": "1"})
    b = labels.label_set({"owner": "y"})
    assert labels.pairs(labels.union(a, b)) == [("epoch", "1"), ("owner", "y")]
    assert labels.pairs(labels.subtract(a, labels.label_set({"owner": "x"}))) == [("epoch", "1")]
    assert labels.pairs(labels.subtract(a, labels.label_set({"owner": "z"}))) == labels.pairs(a)  # values differ
    sel = labels.parse_selector("owner=x")
    assert labels.registers_match(sel, a)
    assert not labels.registers_match(sel, b)
    assert labels.registers_match(sel, pb.LabelSet())  # empty registers match any selector
    assert labels.matches(labels.parse_selector("!owner"), labels.label_set({"epoch": "1"}))


def test_oversized_chunk_is_refused_with_context() -> None:
    with pytest.raises(st.ValidationError, match="exceeds"):
        validate.append_content(pb.AppendRequest(content=b"x" * (validate.MAX_CHUNK + 1)))
