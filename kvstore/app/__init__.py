"""The front-ends: the ``kvstore`` command (:mod:`kvstore.app.cli`), capacity planning
(:mod:`kvstore.app.plan`), a daemon started from Python (:mod:`kvstore.app.local`) and the
benchmarks (:mod:`kvstore.app.bench`). They sit above everything else: the daemon, the clients
and the tiers never import them (``tests/test_structure.py``)."""
