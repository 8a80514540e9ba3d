"""Test support shared by the worker, client and end-to-end suites (worker_proc: a real
dspark-worker in a subprocess)."""
