"""specs/ and kvref_model/ name the same actions and invariants."""

import re
from pathlib import Path

from kvref_model.core import ACTIONS
from kvref_model.invariants import INTERESTING, INVARIANT_IDS, NOT_IN_MODEL, STATE, TRANSITION

SPEC = Path(__file__).resolve().parents[2] / "specs" / "stream-lifecycle.md"


def test_action_names_match() -> None:
    text = SPEC.read_text()
    in_spec = set(re.findall(r"^### `(\w+)`", text, re.M))
    assert in_spec == {a.__name__ for a in ACTIONS}


def test_invariant_ids_match() -> None:
    text = SPEC.read_text()
    in_spec = set(re.findall(r"^\| (I\d+) ", text, re.M))
    assert in_spec == set(INVARIANT_IDS)
    in_model = set(STATE) | set(TRANSITION) | set(NOT_IN_MODEL)
    assert in_model == set(INVARIANT_IDS)
    # every checked invariant says what makes it non-vacuous
    assert set(INTERESTING) == set(INVARIANT_IDS) - set(NOT_IN_MODEL)
