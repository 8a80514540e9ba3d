"""dspark-worker: serves DSpark speculative-decoding drafts to serving engines over TCP and Unix
sockets (docs/contract.md). ``python -m dspark_worker`` and the ``dspark-worker`` command are the
same program (``dspark_worker.cli:main``)."""

__version__ = "0.1.0"
