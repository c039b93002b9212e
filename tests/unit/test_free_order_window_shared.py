"""A remove's free order where cached windows share a fork's page (issue 41,
findings (h)).

A hybrid request (a full group and a cached window group, H2-H4) forks one
label into the other: both labels' window streams hold the fork's page at
slot 1 (slot 0 went at the commit, past the window) and a page of their own
at slot 2. A cached window's list runs head first (H4), so whichever of the
two goes last, the page they shared goes free before that stream's own
slot 2 (S6, S22). The model and kvref may order the streams differently,
so the comparison with the model orders only pages the same streams held;
`Driver.check_shared_in_a_list` places the shared page in its holders'
lists.
"""

from __future__ import annotations

import pytest

from kvref.lifecycle.requests import RequestLifecycle
from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import Mismatch, run_trace
from kvref_model import core as m

SCOPE = m.Scope(requests=2, labels=2, device_pages=12, host_pages=3, page_size=2, max_span=3,
                depth=6, sharing=True, groups=(None, 2), margins=(0, 1), window_cache=True,
                salts=("a", "a"))


def step(*segs: tuple[int, int], forks: tuple[tuple[int, int], ...] = ()) -> list[m.Action]:
    """One admitted, planned, written and committed step of request 1."""
    s = m.Step(tuple(m.Seg(1, label, span) for label, span in segs), forks, (), (1,), True)
    return [m.Admit(s), m.Plan(), m.Write(), m.Commit()]


# label 0 grows to 4 tokens; a pre-fork 0 -> 1 shares its pages, and both
# labels decode a token into slot 2, which moves the window group past slot 0
CALLS: list[m.Action] = [m.Ingest(1), *step((0, 2)), *step((0, 2)),
                         *step((0, 1), (1, 1), forks=((0, 1),)), m.Remove(1)]
WINDOWS = ((1, 1), (1, 3))  # internal labels: label * 2 + group, group 1 the window


def test_the_window_streams_share_slot_1_and_hold_slot_2_alone() -> None:
    model = m.Model(SCOPE)
    s = model.init()
    for a in CALLS[:-1]:
        _, s = model.step(s, a)
    one, two = (s.stream_map()[k].table for k in WINDOWS)
    assert one[0] == two[0] == 0 and one[1] == two[1] != 0
    assert 0 != one[2] != two[2] != 0


def test_remove_lets_the_shared_page_go_in_a_window_list() -> None:
    run_trace(m.Model(SCOPE), CALLS, DriverConfig())


def shared_pages_last(mp: pytest.MonkeyPatch) -> None:
    """A remove that lets each stream's own pages go in its list's order,
    then the pages its streams shared: a full-attention fork's shared pages
    are a prefix, last in a tail-first list anyway; a window's are not."""
    orig = RequestLifecycle._release

    def release(self: RequestLifecycle, rid: str, streams: dict[str, object]) -> None:
        table = self._table
        lists = [((rid, label), list(s.page_indices))  # type: ignore[attr-defined]
                 for label, s in streams.items()]
        seen = [p for _, pages in lists for p in pages]
        shared = {p for p in seen if seen.count(p) > 1}
        for last in (False, True):
            for key, pages in lists:
                mine = [p for p in pages if (p in shared) == last]
                if mine:
                    table.give_back(key, mine)
        for s in streams.values():
            s.drop_pages()  # type: ignore[attr-defined]
        orig(self, rid, streams)  # type: ignore[arg-type]

    mp.setattr(RequestLifecycle, "_release", release)


def test_a_shared_page_let_go_after_the_lists_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    shared_pages_last(monkeypatch)
    with pytest.raises(Mismatch, match=r"step 13 Remove.*kvref: the page .*went free out of "
                                       r"each holder's list"):
        run_trace(m.Model(SCOPE), CALLS, DriverConfig())
