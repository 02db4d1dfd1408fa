"""Label sets and selectors (journal labels, registers).

A LabelSet is sorted by (name, value) and may hold several values per name. A selector
matches a set when, for every name its `include` labels give, the set holds one of the values
given for it (an include with an empty value matches any value of that name: Gazette's rule, so
`id=a,id=b` selects either shard and a token means the same in both systems), and no `exclude`
label is present. A selector label named `NAME:prefix` matches a label NAME whose value starts
with its value (Gazette's prefix labels): with the meta-label `name` (`journal_labels`),
`name:prefix=shop/` selects every journal under shop/. Shards and LogPlayer targets have their
own meta-labels, `id` (`shard_labels`) and `target` (`target_labels`), which tokens select them by.
Register semantics follow Gazette: an empty register set matches any `check_registers` selector.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tidings.protocol import protocol_pb2 as pb


def label_set(pairs: Iterable[tuple[str, str]] | Mapping[str, str] | None = None) -> pb.LabelSet:
    """Build a sorted, de-duplicated LabelSet."""
    if pairs is None:
        return pb.LabelSet()
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    uniq = sorted(set((str(k), str(v)) for k, v in items))
    return pb.LabelSet(labels=[pb.Label(name=k, value=v) for k, v in uniq])


def pairs(ls: pb.LabelSet | None) -> list[tuple[str, str]]:
    return [] if ls is None else [(lb.name, lb.value) for lb in ls.labels]


def union(a: pb.LabelSet, b: pb.LabelSet) -> pb.LabelSet:
    """`a` with each name of `b` replaced by b's values (Gazette's UnionLabelSets semantics)."""
    names_b = {lb.name for lb in b.labels}
    return label_set([p for p in pairs(a) if p[0] not in names_b] + pairs(b))


def subtract(a: pb.LabelSet, b: pb.LabelSet) -> pb.LabelSet:
    """`a` without each name whose values equal b's values of that name (Gazette's SubtractLabelSet)."""
    values_b: dict[str, list[str]] = {}
    for lb in b.labels:
        values_b.setdefault(lb.name, []).append(lb.value)
    values_a: dict[str, list[str]] = {}
    for lb in a.labels:
        values_a.setdefault(lb.name, []).append(lb.value)
    return label_set([(k, v) for k, vs in values_a.items() if values_b.get(k) != vs for v in vs])


PREFIX = ":prefix"  # a selector label's name suffix: match values starting with the label's value


def _contains(ls: pb.LabelSet, label: pb.Label) -> bool:
    if label.name.endswith(PREFIX):
        name = label.name[: -len(PREFIX)]
        return any(lb.name == name and lb.value.startswith(label.value) for lb in ls.labels)
    for lb in ls.labels:
        if lb.name == label.name and (label.value == "" or lb.value == label.value):
            return True
    return False


def matches(selector: pb.LabelSelector | None, ls: pb.LabelSet) -> bool:
    """Whether `ls` is selected: for each name of the includes one of its values present (Gazette's
    `matchSelector`: several values of a name are alternatives), and no exclude present."""
    if selector is None:
        return True
    if any(_contains(ls, lb) for lb in selector.exclude.labels):
        return False
    include = selector.include.labels
    if len(include) < 2:  # (the usual selector, and every token's per-call one: no grouping)
        return all(_contains(ls, lb) for lb in include)
    names: dict[str, bool] = {}
    for lb in include:
        name = lb.name.removesuffix(PREFIX)  # (`name=a` and `name:prefix=b/` are alternatives, as in Gazette)
        names[name] = names.get(name, False) or _contains(ls, lb)
    return all(names.values())


def journal_labels(name: str, labels: pb.LabelSet) -> pb.LabelSet:
    """A journal's labels with its meta-label `name` (which `name:prefix` selectors match too): what a
    selector, a List's or a token's, is matched against."""
    return union(labels, label_set({"name": name}))


def shard_labels(shard_id: str, labels: pb.LabelSet) -> pb.LabelSet:
    """A shard's labels with its meta-label `id` (Gazette's `ShardSpec.LabelSetExt`): what a List's
    selector and a token's are matched against."""
    return union(labels, label_set({"id": shard_id}))


def target_labels(target: str) -> pb.LabelSet:
    """A LogPlayer target's labels for a token's selector: its meta-label `target` alone (a target has
    no labels of its own)."""
    return label_set({"target": target})


def name_selector(value: str, meta: str = "name") -> pb.LabelSelector:
    """The selector of one item by its meta-label: the journal `name=<value>` (what a call touching one
    journal claims, and what `describe` lists), a shard `id=<value>`, a target `target=<value>`."""
    return pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name=meta, value=value)]))


def registers_match(selector: pb.LabelSelector | None, registers: pb.LabelSet) -> bool:
    """Gazette's check_registers: an empty register set matches any selector."""
    if not registers.labels:
        return True
    return matches(selector, registers)


def parse_selector(text: str) -> pb.LabelSelector:
    """Parse ``name=value,name2,!name3=value,name4!=value`` into a LabelSelector.

    ``name`` alone includes any value; ``!name`` excludes any value; ``name!=v`` excludes one.
    """
    inc: list[tuple[str, str]] = []
    exc: list[tuple[str, str]] = []
    for raw in filter(None, (p.strip() for p in text.split(","))):
        if "!=" in raw:
            k, v = raw.split("!=", 1)
            exc.append((k.strip(), v.strip()))
        elif raw.startswith("!"):
            k, _, v = raw[1:].partition("=")
            exc.append((k.strip(), v.strip()))
        else:
            k, _, v = raw.partition("=")
            inc.append((k.strip(), v.strip()))
    return pb.LabelSelector(include=label_set(inc), exclude=label_set(exc))


def format_labels(ls: pb.LabelSet) -> str:
    return ",".join(f"{k}={v}" if v else k for k, v in pairs(ls))


def format_selector(selector: pb.LabelSelector) -> str:
    """The text form `parse_selector` reads."""
    inc = [f"{k}={v}" if v else k for k, v in pairs(selector.include)]
    exc = [f"{k}!={v}" if v else f"!{k}" for k, v in pairs(selector.exclude)]
    return ",".join(inc + exc)
