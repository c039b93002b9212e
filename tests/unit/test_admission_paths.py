"""One admission logic: the plain-step pass against the general rules.

`admission.plain_grant` is the decode fast path: `validate.step_lengths`,
`validate.step_streams`, `refusal` and `reserve` specialised to a step without
forks, in one pass. It must answer every plain step on every table exactly
as the general rules do: the same misuse (class and message), the same
refusal (kind, pages short, the stream it names), or the same grant (every
stream in the same order, the same pages short). Hypothesis draws the
tables, including offloaded streams, running, failed and finished
retrieves, spare pages, unknown requests (in a segment or only among the
padded ids, R40), a stream named twice and one grown past max_seq_len.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvref import validate
from kvref.core.errors import InvalidStepError, KVRefError
from kvref.core.sharing import NO_SHARING, NoSharing
from kvref.core.streams import CacheStream, OffloadState
from kvref.stepping import admission
from kvref.stepping.step import AdmitFailedReason, KVStep, Segment, StepContext
from tests.unit._manager_fixtures import assert_same, make_manager, snapshot

RIDS = ("r0", "r1", "r2")
LABELS = ("main", "cfg")


def _future(kind: str) -> Future[Any] | None:
    if kind == "none":
        return None
    fut: Future[Any] = Future()
    if kind == "done":
        fut.set_result(None)
    elif kind == "failed":
        fut.set_exception(RuntimeError("copy failed"))
    return fut  # "running": never completes


def _rarely(value: Any, common: Any, odds: int = 6) -> st.SearchStrategy[Any]:
    # most streams are plain, so most steps reach the page count
    return st.sampled_from([common] * (odds - 1) + [value])


@st.composite
def stream_state(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "stored": draw(st.integers(0, 20)),
        "spare": draw(st.integers(0, 2)),
        "offloaded": draw(_rarely(True, False)),
        "future": draw(st.sampled_from(["none"] * 9 + ["running", "done", "failed"])),
        "latched": draw(_rarely(True, False)),
        # a windowed stream's released pages (W1), as a count of whole pages
        # before its length; 0 is full attention
        "released_pages": draw(st.sampled_from([0, 0, 1, 2, 5])),
        # its partial last page is shared or registered: a copy-on-write (R52)
        "shared_tail": draw(st.booleans()),
    }


@st.composite
def world(draw: st.DrawFn) -> tuple[dict[str, dict[str, dict[str, Any]]], list[Segment],
                                    int, int, int, tuple[str, ...]]:
    page_size = draw(st.sampled_from([1, 2, 4]))
    table = {}
    # now and then a request the step names is missing (a misuse)
    for rid in draw(st.lists(st.sampled_from(RIDS), unique=True, min_size=2, max_size=3)):
        labels = draw(st.lists(st.sampled_from(LABELS), unique=True, min_size=1, max_size=2))
        table[rid] = {lb: draw(stream_state()) for lb in labels}
    # streams named once, now and then one named twice (a misuse): duplicates
    # drawn freely made most steps misuses, and few reached the page count
    # mostly the table's own streams, so the page count is reached
    held = [(rid, lb) for rid, labels in table.items() for lb in labels]
    any_key = st.tuples(st.sampled_from(RIDS), st.sampled_from(LABELS))
    key = st.sampled_from([st.sampled_from(held)] * 2 + [any_key]).flatmap(lambda k: k)
    segs = draw(st.lists(
        st.builds(lambda k, span: Segment(k[0], k[1], span), key, st.integers(0, 9)),
        max_size=5, unique_by=lambda seg: (seg.request_id, seg.label)))
    if segs and draw(_rarely(True, False)):
        segs.append(draw(st.sampled_from(segs)))
    max_seq_len = draw(st.sampled_from([8, 16, 1 << 20]))  # now and then too long a stream
    # the batch's requests, now and then one the table lacks
    padded = tuple(draw(st.lists(st.sampled_from(RIDS), unique=True, max_size=3)))
    return table, segs, page_size, draw(st.integers(0, 12)), max_seq_len, padded


def _build(spec: dict[str, dict[str, dict[str, Any]]],
           page_size: int) -> dict[str, dict[str, CacheStream]]:
    """A fresh stream table from a drawn spec (page numbers only need be distinct)."""
    table: dict[str, dict[str, CacheStream]] = {}
    page = 1
    for rid, labels in spec.items():
        table[rid] = {}
        for label, s in labels.items():
            stream = CacheStream()
            stream.stored_len = s["stored"]
            released = min(s["released_pages"], s["stored"] // page_size) * page_size
            stream.released = released
            n = -(-s["stored"] // page_size) - released // page_size + s["spare"]
            stream.page_indices = list(range(page, page + n))
            stream.tail_maybe_shared = s["shared_tail"]
            page += n
            stream.offloaded = s["offloaded"]  # by hand: a drawn state, not a history
            stream.offload = OffloadState.OFFLOADED if s["offloaded"] else OffloadState.RESIDENT
            stream.read_future = _future(s["future"])
            stream.read_pending = stream.read_future is not None
            if s["latched"] and s["future"] == "none":
                stream.read_error = RuntimeError("latched earlier")
            table[rid][label] = stream
    return table


def _answer(decide: Any) -> Any:
    """A comparable answer: the misuse raised, the refusal, or the grant's claims."""
    try:
        out = decide()
    except KVRefError as err:
        return ("raised", type(err), str(err))
    if isinstance(out, AdmitFailedReason):
        return ("refused", type(out), out)
    # streams by (request, label) and identity of the created/held object
    claims = [(rid, label, None if s is None else (s.stored_len, tuple(s.page_indices)), short)
              for rid, _streams, label, s, short in out.claims]
    return ("granted", claims, out.new_pages, out.cow)


class _SharedTails(NoSharing):
    """Sharing as `PrefixSharing` answers a step without forks: a stream whose
    tail may be shared and whose length ends mid-page copies that page
    before writing (R52)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def cow_needed(self, key: tuple[str, str], stream: CacheStream) -> bool:
        return stream.tail_maybe_shared and stream.stored_len % self.page_size != 0


def _general(table: dict[str, dict[str, CacheStream]], step: KVStep, page_size: int,
             free: int, max_seq_len: int = 1 << 20, padded: tuple[str, ...] = (),
             sharing: _SharedTails | None = None) -> Any:
    validate.step_lengths(step, StepContext(), table, max_seq_len)
    validate.step_streams(table, step, padded)
    keys = admission.named_keys(step, ())
    refused = admission.refusal(table, keys)
    if refused is not None:
        return refused
    return admission.reserve(table, step, (), keys, page_size, free,
                             sharing=sharing or NO_SHARING)


@given(world(), st.booleans())
def test_plain_pass_answers_as_the_general_rules(w: Any, shared: bool) -> None:
    """Over windowed streams (a released prefix) and both sharing settings too:
    the two label behaviours and the prefix cache on and off that the
    lockstep's configurations draw."""
    spec, segs, page_size, free, max_len, padded = w
    step = KVStep(segs)
    sharing = _SharedTails(page_size) if shared else None
    # a table each: a retrieve's outcome is latched on the stream when read
    general = _answer(lambda: _general(_build(spec, page_size), step, page_size, free,
                                       max_len, padded, sharing))
    plain = _answer(lambda: admission.plain_grant(_build(spec, page_size), step, page_size,
                                                  free, max_len, padded=padded,
                                                  sharing=sharing))
    event(general[0])  # raised / refused / granted: each must arise (--hypothesis-show-statistics)
    if general[0] == "granted":
        event("granted with a copy-on-write" if general[3] else "granted, no copy")
    assert plain == general
    if plain[0] == "granted":
        _plain_rows_agree(admission.plain_grant(_build(spec, page_size), step, page_size,
                                                free, max_len, padded=padded, sharing=sharing))


def _plain_rows_agree(grant: Any) -> None:
    """What the plain admit applies besides the claims: each claim's stream,
    and the rows it creates or grows, in order (the rest it only marks)."""
    assert isinstance(grant, admission.Grant) and grant.streams is not None
    assert grant.streams == [c[3] for c in grant.claims]
    assert grant.work == [i for i, c in enumerate(grant.claims) if c[3] is None or c[4] > 0]


PLAIN = {"stored": 5, "spare": 0, "offloaded": False, "future": "none", "latched": False,
         "released_pages": 0, "shared_tail": False}
ENGAGED = {
    "offloaded": {"offloaded": True},
    "retrieve-running": {"future": "running"},
    "retrieve-failed": {"future": "failed"},
    "retrieve-done": {"future": "done"},
    "failure-latched": {"latched": True},
    "latched-and-offloaded": {"latched": True, "offloaded": True},
}


@pytest.mark.parametrize("second", [False, True], ids=["alone", "second"])
@pytest.mark.parametrize("kind", list(ENGAGED), ids=list(ENGAGED))
def test_each_stream_that_may_refuse_is_ruled_as_in_general(kind: str, second: bool) -> None:
    """Every way a stream may refuse an admit, on the step's first or second
    stream: the plain pass must notice it, whatever the drawn tables hold."""
    spec = {"r0": {"main": dict(PLAIN)}, "r1": {"main": {**PLAIN, **ENGAGED[kind]}}}
    segs = [Segment("r0", "main", 1)] if second else []
    step = KVStep([*segs, Segment("r1", "main", 1)])
    general = _answer(lambda: _general(_build(spec, 4), step, 4, 10))
    assert general[0] == ("granted" if kind == "retrieve-done" else "refused")
    assert _answer(lambda: admission.plain_grant(_build(spec, 4), step, 4, 10, 1 << 20)) == general


def test_plain_pass_grants_claims_holding_the_table_streams() -> None:
    """The claims name the table's own objects: applying them changes the table."""
    table = _build({"r0": {"main": dict(PLAIN)}}, 4)
    grant = admission.plain_grant(table, KVStep([Segment("r0", "main", 4),
                                                 Segment("r0", "cfg", 3)]), 4, 10, 64)
    assert isinstance(grant, admission.Grant)
    (rid0, streams0, label0, s0, short0), (rid1, streams1, label1, s1, short1) = grant.claims
    assert (rid0, label0, short0) == ("r0", "main", 1)  # 9 tokens on 4-token pages
    assert streams0 is table["r0"] and s0 is table["r0"]["main"]
    assert (rid1, label1, s1, short1) == ("r0", "cfg", None, 1)  # created by the admit
    assert streams1 is table["r0"] and grant.new_pages == 2


@pytest.mark.parametrize("label", ["main", "draft"])
def test_a_plain_step_past_max_seq_len_is_refused_on_the_plain_path(label: str) -> None:
    """Nothing admitted or staged, no forks: the admit takes the plain pass,
    which checks the lengths itself (`draft`: a stream the admit would make)."""
    kv = make_manager(max_seq_len=32)
    kv.ingest_request("a")
    step = KVStep([Segment("a", "main", 5)])
    for call in (kv.admit, kv.plan, kv.commit):
        call(step, StepContext())
    base = 5 if label == "main" else 0
    before = snapshot(kv)
    with pytest.raises(InvalidStepError, match=f"'a'.*'{label}'.*past KVConfig.max_seq_len 32"):
        kv.admit(KVStep([Segment("a", "main", 1), Segment("a", label, 32 - base + 1)]
                        if label != "main" else [Segment("a", label, 32 - base + 1)]),
                 StepContext())
    assert_same(before, snapshot(kv))
    # exactly max_seq_len fits
    assert kv.admit(KVStep([Segment("a", label, 32 - base)]), StepContext()).ok


@pytest.mark.parametrize("page_size", [2, 4])
@pytest.mark.parametrize("released_pages", [0, 1], ids=["full", "windowed"])
@pytest.mark.parametrize("shared_tail", [False, True], ids=["private-tail", "shared-tail"])
@pytest.mark.parametrize("sharing_on", [False, True], ids=["no-cache", "cache"])
def test_plain_pass_counts_windows_and_copies_as_in_general(
        page_size: int, released_pages: int, shared_tail: bool, sharing_on: bool) -> None:
    """Each label behaviour (a released prefix or none) and each sharing
    setting (a tail to copy or none), on a stream ending mid-page: drawn
    tables reach the copy-on-write too rarely to rely on alone."""
    spec = {"r0": {"main": {**PLAIN, "stored": 2 * page_size + 1, "released_pages": released_pages,
                            "shared_tail": shared_tail}}}
    step = KVStep([Segment("r0", "main", page_size)])
    sharing = _SharedTails(page_size) if sharing_on else None
    general = _answer(lambda: _general(_build(spec, page_size), step, page_size, 10,
                                       sharing=sharing))
    assert general[0] == "granted"
    assert bool(general[3]) == (shared_tail and sharing_on)
    plain = _answer(lambda: admission.plain_grant(_build(spec, page_size), step, page_size, 10,
                                                  1 << 20, sharing=sharing))
    assert plain == general


NAMED = {
    "a new label, span 0": [Segment("r0", "main", 1), Segment("r0", "cfg", 0)],
    "a new label, span 0, twice": [Segment("r0", "cfg", 0), Segment("r0", "cfg", 0)],
    "a new label twice": [Segment("r0", "cfg", 2), Segment("r0", "cfg", 1)],
    "a held stream twice": [Segment("r0", "main", 1), Segment("r0", "main", 1)],
    "two new labels": [Segment("r0", "cfg", 0), Segment("r0", "draft", 3)],
}


@pytest.mark.parametrize("segs", list(NAMED.values()), ids=list(NAMED))
def test_streams_the_admit_creates_or_names_twice(segs: list[Segment]) -> None:
    """The rows the draws reach rarely: a stream the admit creates with no
    pages to take, and a stream (held, or created) named twice (a misuse)."""
    spec = {"r0": {"main": dict(PLAIN)}}
    step = KVStep(segs)
    general = _answer(lambda: _general(_build(spec, 4), step, 4, 10))
    plain = _answer(lambda: admission.plain_grant(_build(spec, 4), step, 4, 10, 1 << 20))
    assert plain == general
    if plain[0] == "granted":
        _plain_rows_agree(admission.plain_grant(_build(spec, 4), step, 4, 10, 1 << 20))
