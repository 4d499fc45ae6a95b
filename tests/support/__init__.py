"""What the tests share besides fixtures: harnesses (a gateway in the test's loop, the real components some
suites need), builders and a clock the tests move by hand. Imported as ``support.<module>``: the test
configuration puts ``tests/`` on ``sys.path`` (``pythonpath`` in pyproject.toml)."""
