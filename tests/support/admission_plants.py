"""Defects planted in admission's fast path (`admission.plain_grant`), as
monkeypatches, each found by the lockstep's check of the fast path against
the general rules before every admit (`tests/support/admission_check.py`).
tests/conformance/test_admission_paths_lockstep.py runs them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvref.core.refusals import AllocationFailed
from kvref.stepping import admission
from kvref.stepping.step import KVStep


def plain_admission_names_the_last_short_stream(mp: pytest.MonkeyPatch) -> None:
    """The fast path's refusal names the last stream short of pages, where the
    general rule names the first: an engine that evicts for the stream
    named evicts for the wrong one. The model does not compare the stream
    a refusal names (only its kind and pages short), so without the check
    of the two paths the lockstep passes it."""
    orig = admission.plain_grant

    def plain_grant(table: Any, step: KVStep, page_size: int, free: int, max_seq_len: int,
                    **kwargs: Any) -> Any:
        out = orig(table, step, page_size, free, max_seq_len, **kwargs)
        if not isinstance(out, AllocationFailed):
            return out
        last = None
        for seg in step.segments:
            stream = table[seg.request_id].get(seg.label)
            short = (-(-seg.span // page_size) if stream is None else
                     -(-(stream.stored_len + seg.span) // page_size)
                     - stream.released // page_size - len(stream.page_indices))
            if short > 0:
                last = seg
        if last is None:
            return out
        return dataclasses.replace(out, request_id=last.request_id, label=last.label)

    mp.setattr(admission, "plain_grant", plain_grant)


PLANTS = {"plain_admission_names_the_last_short_stream":
          plain_admission_names_the_last_short_stream}
