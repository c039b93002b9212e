"""kvref's stream lifecycle as an executable abstract model (no torch, no kvref).

`Model(scope).init()` and `Model.step(state, action) -> (result, state)` are
the whole model (kvref_model.core); kvref_model.invariants states I1-I16, kvref_model.protocol
the engine's preconditions, kvref_model.check the exhaustive bounded checker, and
kvref_model.reference the reference manager's rules for specs/findings.md.
"""

from kvref_model.core import Model, Scope, State

__all__ = ["Model", "Scope", "State", "reachable"]


def reachable(scope: Scope, model: type[Model] = Model):  # type: ignore[no-untyped-def]
    """See kvref_model.check.reachable (imported lazily: check imports this package)."""
    from kvref_model.check import reachable as r
    return r(scope, model)
