"""What the model knows of kvref beyond streams and pages, checked on what
`KVManager.observe` shows (issue 44, item 4): the staged preplan and what it
was planned against, each request's cache config, a stream's position and
the ids its keyed pages were keyed with. Read through the observation only,
so a manager wrapped by composition is checked the same way.

Each check takes the model's state after the same call and raises
`AssertionError` naming what disagrees.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvref import KVObservation
from kvref_model import core as m

# the harness's names: kvref's id of a model request (`Driver.name`: ids are
# used again after a remove), the id an engine names a token of identity t at
# position p by (`driver.engine_id`), and the (cache_salt, extra_keys) a model
# salt stands for (`driver.request_keys`)
Namer = Callable[[int], str]
TokenId = Callable[[int, int], int]
RequestKeys = Callable[[str], tuple[str | None, tuple[tuple[str, str], ...]]]
# kvref's stream label of a model (internal) label: a hybrid scope's group
# label (`kvref.testing.group_map.GroupMap.kv_label`)
LabelName = Callable[[int], str]


def rid_name(rid: int) -> str:
    return f"r{rid}"


def label_name(label: int) -> str:
    return m.LABEL_NAMES[label]


def key_name(key: m.Key, name: Namer = rid_name,
             label: LabelName = label_name) -> tuple[str, str]:
    return name(key[0]), label(key[1])


def check_positions(seen: KVObservation) -> None:
    """W4: a stream's position is its length; its keyed ids cover exactly its
    keyed pages (what a later `cache_prefix` is compared with)."""
    ps = seen.page_size
    for s in seen.streams():
        where = f"{s.request_id}/{s.label}"
        assert s.position == s.stored_len, (
            f"W4: {where} at position {s.position}, holding {s.stored_len} tokens")
        assert len(s.key_tokens) == 8 * ps * s.keyed_pages, (
            f"{where}: {len(s.key_tokens) // 8} keyed ids for {s.keyed_pages} keyed pages")


def check_keyed_ids(model_state: m.State, seen: KVObservation, page_size: int,
                    name: Namer = rid_name,
                    token_id: TokenId = lambda t, p: t,
                    label: LabelName = label_name) -> None:
    """The ids a stream's keyed pages were keyed with are the ids the
    engine names the tokens the model says it holds there (`token_id` of
    each, `Driver.engine_ids`; a hit attaches what its ids name)."""
    for key, v in model_state.streams:
        if not v.chain:
            continue
        rid, lb = key_name(key, name, label)
        got = seen.stream(rid, lb).keyed_ids()
        want = tuple(token_id(t, p) for p, t in enumerate(v.contents[:v.chain * page_size]))
        assert got == want, (
            f"{rid}/{lb}: its {v.chain} keyed pages were keyed with ids {got}, "
            f"the model's tokens there are {want}")


def check_configs(model_state: m.State, seen: KVObservation,
                  salts: Mapping[int, str], name: Namer = rid_name,
                  keys: RequestKeys = lambda salt: (salt or None, ())) -> None:
    """Every request the model has keeps the config it was ingested with
    (its salt as `keys` turns it into a cache salt and extra keys), and a
    removed request's is gone (a request id used again must not key under
    the old one's salt or extra keys)."""
    want = {name(r): keys(salts.get(r, "")) for r in model_state.requests()}
    got = {rid: (c.cache_salt, tuple(c.extra_keys)) for rid, c in seen.configs.items()}
    assert got == want, f"request configs (salt, extra keys) {got}, the model's {want}"


def check_staged(model_state: m.State, seen: KVObservation, name: Namer = rid_name,
                 label: LabelName = label_name) -> None:
    """R41, R42: a preplan is staged exactly when the model has one, of the
    same step, planned or not alike, built from the same lengths of the
    streams the running step leaves."""
    p, staged = seen.preplan, model_state.staged
    assert (p is None) == (staged is None), (
        f"kvref's staged preplan {p}, the model's {staged}")
    if p is None or staged is None:
        return
    step = staged.step
    want_segments = tuple((*key_name((g.rid, g.label), name, label), g.span)
                          for g in step.segments)
    got_segments = tuple((g.request_id, g.label, g.span) for g in p.segments)
    assert got_segments == want_segments, (
        f"staged segments {got_segments}, the model's {want_segments}")
    assert p.padded == tuple(name(r) for r in step.padded), (p.padded, step.padded)
    assert p.commit == step.commit, (p.commit, step.commit)
    assert p.pre_forks == tuple((label(a), label(b)) for a, b in step.pre_forks)
    assert p.post_forks == tuple((label(a), label(b)) for a, b in step.post_forks)
    assert p.planned == (staged.phase != m.ADMITTED), (
        f"staged preplan planned {p.planned}, the model's in phase {staged.phase}")
    want_basis = {key_name(k, name, label): n for k, n in staged.basis}
    assert dict(p.basis) == want_basis, (
        f"R42: the preplan was planned against {dict(p.basis)}, the model's basis "
        f"{want_basis}")
