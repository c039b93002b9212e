"""One admission rule over the lockstep's own steps (issue 29, build 3).

The lockstep driver holds admission's fast path (`admission.plain_grant`) to
the general rules before every admit it issues
(`tests/support/admission_check.py`), so every state and step shape the
lockstep draws is a case of the equality `tests/unit/test_admission_paths.py`
checks on drawn tables. The clean tree passes it in `test_lockstep` (200
examples of the ci profile as shipped, 100 with sharing off); here a divergence planted in the fast
path is found by it within the same budget of examples.
"""

from __future__ import annotations

import pytest

from kvref.testing.lockstep import PLAIN_SCOPE, SCOPE
from tests.support import admission_plants
from tests.support.plant_layers import lockstep

# plant -> the scopes whose lockstep finds it (docs/verification/planted-bugs.md
# records at which example: 141 here as shipped; 241 with sharing off, from a script)
FOUND_IN: dict[str, tuple[str, ...]] = {
    "plain_admission_names_the_last_short_stream": ("as-shipped",),
}
BUDGET = 200  # the examples the clean tree passes in test_lockstep (LOCKSTEP_CI)
SCOPES = {"as-shipped": SCOPE, "sharing-off": PLAIN_SCOPE}


@pytest.mark.parametrize(("name", "scope"), [(n, s) for n, at in FOUND_IN.items() for s in at])
def test_the_lockstep_finds_a_fast_path_divergence(name: str, scope: str) -> None:
    found = lockstep(admission_plants.PLANTS[name], SCOPES[scope], BUDGET)
    print(f"found at example {found.at} of {found.ran}")
    assert found.at is not None, found
    assert "admission's fast path answers" in found.message, found.message
