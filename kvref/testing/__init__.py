"""The verification harness kvref is tested with, shipped for engine teams:
the lockstep machine (`lockstep.run_lockstep`), the conformance driver
(`driver.DriverConfig`, whose factory builds the manager under test), the
exhaustive replay (`exhaustive.check_scope`), a pytest plugin for the
``--kvref-*`` options (`plugin`) and ready-made tests over them (`suite`):

    pytest -p kvref.testing.plugin --pyargs kvref.testing.suite \\
        --kvref-factory mypkg.mod:make_manager

The harness reads the manager only through its public calls and
`KVManager.observe` (`driver.ManagerUnderTest` lists them), so a manager
that wraps `KVManager` rather than subclassing it is driven as well.

Needs the ``testing`` extra (``pip install 'kvref[testing]'``)."""
