"""One admission rule: the fast path held to the general one on live states.

`Stepping.admit` answers a plain step (no forks, no preplan, nothing
admitted or staged: every decode step) through `admission.plain_grant`, and
every other step through the general rules (`validate.step_lengths`,
`validate.step_streams`, `admission.refusal`, `admission.reserve`). The
lockstep driver calls `check_plain_admission` before each admit it issues
(`DriverConfig.before_admit`, set by tests/conformance/conftest.py and
`tests.support.plant_layers.lockstep`),
so the two are compared on every state and step shape the lockstep
reaches, sharing on and off, windows and spare pages included, not only on
tables a unit test draws. Neither side changes a stream beyond latching a
finished retrieve's outcome, which the admit that follows does alike.
"""

from __future__ import annotations

from typing import Any

from kvref import validate
from kvref.core.errors import KVRefError
from kvref.manager import KVManager
from kvref.stepping import admission
from kvref.stepping.step import AdmitFailedReason, KVStep, StepContext


def takes_plain_path(kv: KVManager, step: KVStep, ctx: StepContext) -> bool:
    """Whether ``kv.admit(step, ctx)`` now answers through `plain_grant`
    (`Stepping.admit`'s own condition)."""
    stepping, table = kv._stepping, kv._table
    return stepping.preplan is None and stepping.running is None and not (
        ctx.is_preplan or step.pre_forks or step.post_forks or step.combined_labels
    ) and not (table.releasing and table.leases.leased())


def _answer(decide: Any) -> Any:
    """A comparable answer: the misuse raised, the refusal, or the grant."""
    try:
        out = decide()
    except KVRefError as err:
        return ("raised", type(err).__name__, str(err))
    if isinstance(out, AdmitFailedReason):
        return ("refused", out)
    # streams by (request, label) and identity: the claims name the table's objects
    claims = [(rid, label, None if s is None else id(s), short)
              for rid, _streams, label, s, short in out.claims]
    return ("granted", claims, out.new_pages, out.cow, out.privatise)


def general_answer(kv: KVManager, step: KVStep, ctx: StepContext) -> Any:
    """The general rules' answer to a plain step, changing nothing."""
    table = kv._table
    streams, padded = table.streams, tuple(ctx.padded_request_ids)

    def decide() -> Any:
        validate.step_lengths(step, ctx, streams, kv.config.max_seq_len)
        validate.step_streams(streams, step, padded)
        keys = admission.named_keys(step, padded)
        refused = admission.refusal(streams, keys)
        if refused is not None:
            return refused
        return admission.reserve(streams, step, padded, keys, table.page_size,
                                 table.pages.num_free, sharing=table.sharing,
                                 behaviour=table.behaviour if table.releasing else None)

    return _answer(decide)


def plain_answer(kv: KVManager, step: KVStep, ctx: StepContext) -> Any:
    """`plain_grant`'s answer, as `Stepping.admit` asks it, changing nothing."""
    table = kv._table
    return _answer(lambda: admission.plain_grant(
        table.streams, step, table.page_size, table.pages.num_free, kv.config.max_seq_len,
        padded=tuple(ctx.padded_request_ids),
        sharing=table.sharing if table.tails_maybe_shared else None))


def check_plain_admission(kv: object, step: KVStep, ctx: StepContext) -> None:
    """Raise AssertionError if the fast path would answer ``step`` otherwise
    than the general rules on ``kv``'s state now; nothing if ``kv`` would
    not take the fast path (or is not a `KVManager`). Under the manager's
    lock, as an admit is."""
    if not isinstance(kv, KVManager):
        return
    with kv._lock:
        if not takes_plain_path(kv, step, ctx):
            return
        general = general_answer(kv, step, ctx)
        plain = plain_answer(kv, step, ctx)
    if plain != general:
        raise AssertionError(f"admission's fast path answers {step!r} with {plain!r}, "
                             f"the general rules with {general!r}")
