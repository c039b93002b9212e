"""How many device pages a step's admit would take now, without taking them.

The count is `kvref.stepping.admission`'s own reservation (forks applied in order,
R9 and R20 included), run against an unbounded free count so it always
answers with the pages rather than a refusal: one set of rules for the
query and the call (R46).
"""

from __future__ import annotations

import sys

from kvref import validate
from kvref.core.stream_table import StreamTable
from kvref.stepping import admission
from kvref.stepping.step import KVStep, StepContext


def step_pages(table: StreamTable, step: KVStep, ctx: StepContext, max_seq_len: int) -> int:
    """New pages `KVManager.admit` would reserve for ``step``. Under the table's lock.

    Raises what admit raises for misuse (an unknown request, a stream twice,
    a stream past ``max_seq_len``); answers regardless of the lifecycle
    refusals admit would give (an offloaded stream counts from the pages it
    holds, none; a stream still receiving a retrieve from its length).
    """
    validate.step_lengths(step, ctx, table.streams, max_seq_len)
    padded = tuple(ctx.padded_request_ids)
    validate.step_streams(table.streams, step, padded)
    keys = admission.named_keys(step, padded)
    grant = admission.reserve(table.streams, step, padded, keys, table.page_size,
                              free=sys.maxsize, sharing=table.sharing,
                              copy_forks=ctx.is_preplan,
                              behaviour=table.behaviour if table.releasing else None)
    assert isinstance(grant, admission.Grant), "no step needs more than sys.maxsize pages"
    return grant.new_pages
