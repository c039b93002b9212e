"""kvref's stream lifecycle as an executable abstract model (no torch, no kvref).

`Model(scope).init()` and `Model.step(state, action) -> (result, state)` are
the whole model (model.core); model.invariants states I1-I16, model.protocol
the engine's preconditions, model.check the exhaustive bounded checker, and
model.reference the reference manager's rules for specs/findings.md.
"""

from model.core import Model, Scope, State

__all__ = ["Model", "Scope", "State", "reachable"]


def reachable(scope: Scope, model: type[Model] = Model):  # type: ignore[no-untyped-def]
    """See model.check.reachable (imported lazily: check imports this package)."""
    from model.check import reachable as r
    return r(scope, model)
