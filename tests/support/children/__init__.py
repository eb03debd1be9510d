"""Scripts the tests run as child processes, and ``harness.py`` shared with those tests."""
