"""One admission rule over the lockstep's own steps (issue 29, build 3).

The lockstep driver holds admission's fast path (`admission.plain_grant`) to
the general rules before every admit it issues
(`kvref.testing.admission_check`), so every state and step shape the
lockstep draws is a case of the equality `tests/unit/test_admission_paths.py`
checks on drawn tables. The clean tree passes it in `test_lockstep` (the ci
profile's 400 examples, both scopes); here a divergence planted in the fast
path is found by it, derandomized, at the example recorded (a change that
finds it later, or not at all, fails).
"""

from __future__ import annotations

import pytest

from kvref.testing.lockstep import PLAIN_SCOPE, SCOPE
from tests.support import admission_plants
from tests.support.plant_layers import lockstep

# plant -> scope -> the derandomized example at which the lockstep finds it
FOUND_AT: dict[str, dict[str, int]] = {
    "plain_admission_names_the_last_short_stream": {"as-shipped": 62},
}
SCOPES = {"as-shipped": SCOPE, "sharing-off": PLAIN_SCOPE}


@pytest.mark.parametrize(("name", "scope"), [(n, s) for n, at in FOUND_AT.items() for s in at])
def test_the_lockstep_finds_a_fast_path_divergence(name: str, scope: str) -> None:
    at = FOUND_AT[name][scope]
    found = lockstep(admission_plants.PLANTS[name], SCOPES[scope], at)
    assert found.at is not None and found.at <= at, found
    assert "admission's fast path answers" in found.message, found.message
