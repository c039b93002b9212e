"""Pytest plugin for mutation runs (loaded with ``-p tests.mutation_profile``).

A mutant that a Hypothesis test catches is killed by the first failing
example; shrinking it (minutes under load) only turns a kill into a timeout.
So mutation runs generate without shrinking, derandomized for repeatable
verdicts, and keep no example database between mutants.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "mutation", max_examples=50, stateful_step_count=30, deadline=None,
    derandomize=True, database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
# tests/conftest.py loads the profile named here when it is imported
os.environ["HYPOTHESIS_PROFILE"] = "mutation"
settings.load_profile("mutation")
