"""The verification harness kvref is tested with, shipped for engine teams:
the lockstep machine (`lockstep.run_lockstep`), the conformance driver
(`driver.DriverConfig`, whose factory builds the manager under test) and the
exhaustive replay (`exhaustive.check_scope`). Needs the ``testing`` extra."""
