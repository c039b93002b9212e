"""The reference manager's rules, as a variant of the model.

Used only to write specs/findings.md: the checker runs on this variant to
show which invariant each kvref rule (specs/rules.md) protects.  Every
difference from `Model` is a rule switched off, except `do_Admit`, whose
reference form is sequential (R1 off: a refusal keeps what it took).
"""

from __future__ import annotations

from dataclasses import replace

from kvref_model.core import (
    RESIDENT,
    Admit,
    Key,
    Model,
    Ok,
    Refused,
    Result,
    State,
    Stream,
    Tokens,
    _sorted,
    named,
)


class ReferenceModel(Model):
    R1_atomic_admit = False
    R2_mark_everything_named = False
    R3_offloaded_refuses = False
    R5_no_reset_in_flight = False
    R6_no_reload_mid_offload = False
    R7_reset_clears_latch = False
    R9_fork_then_grow = False
    R11_preplan_forks_at_promotion = False
    R12_reset_forgets_host = False
    R13_publish_resident = False
    R14_retrieve_refuses_named = False
    R15_retrieve_refuses_absent_named = False
    R16_admit_makes_named = False
    R21_publish_complete = False
    R22_admit_waits_for_retrieve = False
    R24_commit_runs_pending_forks = False
    R33_publish_leases = False
    R35_stale_retrieve_latched = False
    R41_preplan_over_running_step = False
    R42_promotion_checks_basis = False
    R43_shared_marks = False
    # the reference's clear_preplan removes invented fork targets only, not
    # labels a preplan's segment created; kvref removes both (DESIGN.md)
    UNDO_ALL_INVENTED = False

    def do_Admit(self, s: State, a: Admit) -> tuple[Result, State]:
        if self.R1_atomic_admit and self.R3_offloaded_refuses:
            return super().do_Admit(s, a)
        misuse = self._misused(s, a)
        if misuse is not None:
            return misuse, s
        if not a.preplan and (s.staged is not None or s.current is not None):
            return Ok(), s
        st, before = s.stream_map(), s.stream_map()
        keys = named(a.step)
        if self.R3_offloaded_refuses and any(st[k].offload != RESIDENT for k in keys if k in st):
            return Refused("RequestOffloading"), s
        free = s.free
        pool = s.pool
        assert pool is not None
        growth: dict[Key, int] = {}
        for g in a.step.segments:
            if a.step.commit:
                growth[(g.rid, g.label)] = growth.get((g.rid, g.label), 0) + g.span

        def alloc(k: Key, tokens: int) -> Result | None:
            nonlocal free, pool
            v = st.setdefault(k, Stream())  # the label exists from here on
            if v.offload != RESIDENT:
                return Refused("RequestOffloading")
            new = max(0, self.need(tokens) - v.pages)
            if new > free:  # pages_short: this reservation's, not the step's
                return Refused("AllocationFailed", new - free)
            assert pool is not None
            got, pool = self._alloc(pool, k, new)
            st[k], free = self.tab(v, v.table + got), free - new
            return None

        def refused() -> State:  # R1 off: partial reservations and labels are kept
            return s if self.R1_atomic_admit else replace(s, free=free, streams=_sorted(st),
                                                          pool=pool)

        undo: list[tuple[Key, Tokens | None]] = []
        for forks, post in ((a.step.pre_forks, False), (a.step.post_forks, True)):
            for f, t in forks:
                for rid in a.step.padded:
                    extra = growth.get((rid, f), 0) if post else 0
                    if a.preplan and (rid, t) not in st:
                        if not self.UNDO_ALL_INVENTED:  # _preplan_new_labels: fork targets
                            undo.append(((rid, t), None))
                    elif a.preplan and not post:
                        undo.append(((rid, t), st[(rid, t)].contents))
                    if (rid, f) not in st:
                        r = alloc((rid, t), extra) if extra > 0 else None
                    elif st[(rid, f)].offload != RESIDENT:
                        r = Refused("RequestOffloading")
                    else:
                        r = alloc((rid, t), st[(rid, f)].stored_len + extra)
                    if r is not None:
                        return r, refused()
        for g in a.step.segments:
            if g.span > 0:
                k = (g.rid, g.label)
                base = st.get(k, Stream()).stored_len
                src = [f for f, t in a.step.pre_forks if t == g.label and (g.rid, f) in st]
                if self.R9_fork_then_grow and src and g.rid in a.step.padded:
                    base = st[(g.rid, src[0])].stored_len
                r = alloc(k, base + g.span)
                if r is not None:
                    return r, refused()
        marks = frozenset(k for k in {(g.rid, g.label) for g in a.step.segments} if k in st)
        fresh = frozenset(k for k in st if k not in before)
        if a.preplan and self.UNDO_ALL_INVENTED:  # DESIGN: every invented label goes
            undo = [(k, None) for k in sorted(fresh)] + [u for u in undo if u[1] is not None]
        return Ok(), self._admitted(replace(s, pool=pool), st, free, a, marks, tuple(undo),
                                    fresh, asked=s)


def without(*rules: str) -> type[Model]:
    """kvref's model with the named rules switched off (an ablation)."""
    attrs: dict[str, object] = {}
    attrs["UNDO_ALL_INVENTED"] = True
    for r in rules:
        names = [n for n in vars(Model) if n.startswith(r + "_")]
        if not names:
            raise ValueError(f"no rule {r}")
        attrs[names[0]] = False
    base: type[Model] = ReferenceModel if {"R1", "R3"} & set(rules) else Model
    if base is ReferenceModel:  # keep every other rule on
        for n in vars(Model):
            if n[:1] == "R" and n[1].isdigit() and n not in attrs:
                attrs[n] = True
    return type("Without_" + "_".join(rules), (base,), attrs)
